//! The one admission rule every backend that stores holders applies.

use crate::error::{Error, Result};
use crate::mode::Mode;

/// What to do with a request, given the current (unexpired) holders of its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Admission {
    /// The owner already holds in the same mode: add a hold to holder `index`,
    /// keep its token.
    Reenter {
        /// Position of the owner's row among the holders given.
        index: usize,
    },
    /// Grant a new hold with a new token.
    Grant,
    /// Conflicts with a holder (or the semaphore is full): wait.
    Busy,
}

/// Decides a request of `owner` in `mode` against `holders` (owner, mode) of one
/// key. Backends call it inside their transaction or script so that the rule is
/// the same everywhere:
///
/// - the same owner in the same mode re-enters;
/// - `Shared` coexists with `Shared`; `Semaphore{n}` coexists with other
///   holders of `Semaphore{n}` while fewer than `n` hold;
/// - a key has one permit count while held: the first holder's `n` fixes it
///   until the key is free, and a semaphore request with another count is an
///   error (it would bound the holders by a count the others did not agree to);
/// - anything else conflicts.
///
/// # Errors
///
/// [`Error::InvalidConfig`] when the owner already holds the key in another mode
/// (waiting would deadlock on itself), or a semaphore request's permit count
/// is not the one the key is held with.
///
/// # Examples
///
/// ```
/// use fencelock_core::{Mode};
/// use fencelock_core::backend::{admit, Admission};
///
/// let holders = [("a", Mode::Shared), ("b", Mode::Shared)];
/// assert_eq!(admit("k", holders, "c", Mode::Shared)?, Admission::Grant);
/// assert_eq!(admit("k", holders, "c", Mode::Exclusive)?, Admission::Busy);
/// assert_eq!(admit("k", holders, "b", Mode::Shared)?, Admission::Reenter { index: 1 });
/// assert!(admit("k", holders, "b", Mode::Exclusive).is_err());
/// // A semaphore held with 2 permits refuses a request for 3.
/// let sem = [("a", Mode::Semaphore { permits: 2 })];
/// assert_eq!(admit("s", sem, "b", Mode::Semaphore { permits: 2 })?, Admission::Grant);
/// assert!(admit("s", sem, "b", Mode::Semaphore { permits: 3 }).is_err());
/// # Ok::<(), fencelock_core::Error>(())
/// ```
pub fn admit<'a, I>(key: &str, holders: I, owner: &str, mode: Mode) -> Result<Admission>
where
    I: IntoIterator<Item = (&'a str, Mode)>,
{
    let mut busy = false;
    let mut semaphore_holders: u64 = 0;
    for (index, (holder, held)) in holders.into_iter().enumerate() {
        if holder == owner {
            if held == mode {
                return Ok(Admission::Reenter { index });
            }
            return Err(Error::mode_mismatch(owner, key, held, mode));
        }
        if !mode.compatible_with(held) {
            busy = true;
        }
        if let Mode::Semaphore { permits: held_n } = held {
            if let Mode::Semaphore { permits } = mode
                && permits != held_n
            {
                return Err(Error::permits_mismatch(key, held_n, permits));
            }
            semaphore_holders += 1;
        }
    }
    if let Mode::Semaphore { permits } = mode
        && semaphore_holders >= u64::from(permits)
    {
        busy = true;
    }
    Ok(if busy {
        Admission::Busy
    } else {
        Admission::Grant
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exclusive_conflicts_with_everything() {
        assert_eq!(
            admit("k", [], "a", Mode::Exclusive).unwrap(),
            Admission::Grant
        );
        for m in [
            Mode::Exclusive,
            Mode::Shared,
            Mode::Semaphore { permits: 9 },
        ] {
            assert_eq!(
                admit("k", [("x", m)], "a", Mode::Exclusive).unwrap(),
                Admission::Busy
            );
            assert_eq!(
                admit("k", [("x", Mode::Exclusive)], "a", m).unwrap(),
                Admission::Busy
            );
        }
    }

    #[test]
    fn reentering_in_another_mode_is_refused_with_both_modes_named() {
        let e = admit("k", [("a", Mode::Shared)], "a", Mode::Exclusive).unwrap_err();
        assert!(matches!(e, Error::InvalidConfig(_)), "{e:?}");
        let msg = e.to_string();
        assert!(
            msg.contains("\"a\" already holds \"k\" as shared")
                && msg.contains("(asked exclusive)"),
            "{msg}"
        );
        assert_eq!(
            admit("k", [("a", Mode::Shared)], "a", Mode::Shared).unwrap(),
            Admission::Reenter { index: 0 }
        );
    }

    #[test]
    fn semaphore_counts_permits() {
        let s = Mode::Semaphore { permits: 2 };
        assert_eq!(admit("k", [("x", s)], "a", s).unwrap(), Admission::Grant);
        assert_eq!(
            admit("k", [("x", s), ("y", s)], "a", s).unwrap(),
            Admission::Busy
        );
        assert_eq!(
            admit("k", [("x", s), ("y", s)], "y", s).unwrap(),
            Admission::Reenter { index: 1 }
        );
        assert_eq!(
            admit("k", [("x", Mode::Shared)], "a", s).unwrap(),
            Admission::Busy
        );
    }
}
