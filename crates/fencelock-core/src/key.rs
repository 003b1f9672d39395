//! Validated lock keys and owner ids.

use std::fmt;
use std::sync::Arc;

use crate::error::{Error, Result};

/// The longest key or owner id, in bytes.
pub const MAX_KEY_BYTES: usize = 256;

/// The name of a lock: 1 to 256 bytes of UTF-8 without control characters.
///
/// Validation happens before any I/O, so a bad key never reaches a backend.
/// Backends map keys into their own namespace (`fencelock:{key}` in Redis, with
/// `%` and `}` escaped inside the braces,
/// `/fencelock/<escaped key>` in ZooKeeper, `fencelock/<key>/` in etcd, a row
/// in SQL backends).
///
/// # Examples
///
/// ```
/// use fencelock_core::Key;
///
/// let key = Key::new("orders/42")?;
/// assert_eq!(key.as_str(), "orders/42");
/// assert!(Key::new("").is_err());
/// assert!(Key::new("a\nb").is_err());
/// assert!(Key::new("x".repeat(300)).is_err());
/// # Ok::<(), fencelock_core::Error>(())
/// ```
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key(Arc<str>);

impl Key {
    /// Validates `key`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidKey`] if it is empty, longer than 256 bytes, or contains a
    /// control character (newline, tab, NUL, …).
    pub fn new(key: impl AsRef<str>) -> Result<Self> {
        let key = key.as_ref();
        check(key).map_err(|reason| Error::InvalidKey {
            key: shorten(key),
            reason,
        })?;
        Ok(Key(Arc::from(key)))
    }

    /// The key as a string slice.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for Key {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

/// Who holds a lock.
///
/// By default every guard gets a fresh owner (the [`Locker`](crate::Locker)'s
/// random id plus a counter), so two guards never share a hold. Give the same
/// owner explicitly ([`LockBuilder::owner`](crate::LockBuilder::owner)) to make an
/// acquisition **reentrant**: the hold count goes up and the token stays the same
/// (on Redlock it can be larger, see [`Guard::token`](crate::Guard::token)).
///
/// The rules are those of [`Key`].
///
/// # Examples
///
/// ```
/// use fencelock_core::Owner;
///
/// let owner = Owner::new("worker-7")?;
/// assert_eq!(owner.as_str(), "worker-7");
/// assert!(Owner::new("").is_err());
/// # Ok::<(), fencelock_core::Error>(())
/// ```
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Owner(Arc<str>);

impl Owner {
    /// Validates `owner` with the rules of [`Key`].
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] naming the rule that is broken.
    pub fn new(owner: impl AsRef<str>) -> Result<Self> {
        let owner = owner.as_ref();
        check(owner).map_err(|reason| {
            Error::config(format!("invalid owner {:?}: {reason}", shorten(owner)))
        })?;
        Ok(Owner(Arc::from(owner)))
    }

    /// An owner id built by fencelock itself (hex id, colon, digits): valid by construction.
    pub(crate) fn trusted(owner: String) -> Self {
        debug_assert!(check(&owner).is_ok());
        Owner(Arc::from(owner))
    }

    /// The owner id as a string slice.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

fn check(s: &str) -> std::result::Result<(), String> {
    if s.is_empty() {
        return Err("it is empty".into());
    }
    if s.len() > MAX_KEY_BYTES {
        return Err(format!(
            "it is {} bytes long, more than {MAX_KEY_BYTES}",
            s.len()
        ));
    }
    if let Some(c) = s.chars().find(|c| c.is_control()) {
        return Err(format!("it contains the control character {c:?}"));
    }
    Ok(())
}

fn shorten(s: &str) -> String {
    if s.len() <= 64 {
        return s.to_string();
    }
    let mut end = 48;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… ({} bytes)", &s[..end], s.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits() {
        assert!(Key::new("x".repeat(256)).is_ok());
        assert!(Key::new("x".repeat(257)).is_err());
        assert!(Key::new("é".repeat(128)).is_ok()); // 256 bytes
        assert!(Key::new("é".repeat(129)).is_err());
        assert!(Key::new("tab\there").is_err());
        assert!(Key::new("nul\0").is_err());
        assert!(Key::new("spaces and / slashes {braces}").is_ok());
    }

    #[test]
    fn long_key_message_is_shortened() {
        let err = Key::new("é".repeat(200)).unwrap_err().to_string();
        assert!(err.contains("400 bytes"), "{err}");
        assert!(err.len() < 300, "{err}");
    }
}
