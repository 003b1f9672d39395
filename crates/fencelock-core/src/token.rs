//! Fencing tokens.

use std::fmt;

/// A number that strictly increases per key across all holders, handed out with
/// every grant (Chubby's sequencer, Kleppmann's fencing token).
///
/// Send it with every write to the protected resource, and have the resource
/// reject a write whose token is lower than the highest it has seen. A holder
/// that was paused past its lease then cannot do harm: its token is stale.
///
/// A backend that cannot guarantee monotonic tokens (memcached, which may evict)
/// gives none: [`Guard::token`](crate::Guard::token) returns `None` there, never a
/// made-up number.
///
/// # Examples
///
/// ```
/// use fencelock_core::FencingToken;
///
/// let older = FencingToken::new(7);
/// let newer = FencingToken::new(8);
/// assert!(newer > older);
/// assert_eq!(newer.get(), 8);
/// assert_eq!(newer.to_string(), "8");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FencingToken(u64);

impl FencingToken {
    /// Wraps a raw token.
    pub const fn new(value: u64) -> Self {
        FencingToken(value)
    }

    /// The raw number.
    pub const fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl From<FencingToken> for u64 {
    fn from(t: FencingToken) -> u64 {
        t.0
    }
}
