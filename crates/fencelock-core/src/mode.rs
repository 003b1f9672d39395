//! Lock modes: exclusive, shared (readers), semaphore.

use std::fmt;

use crate::error::{Error, Result};

/// How a lock is held.
///
/// | mode | admits at once | excludes |
/// |---|---|---|
/// | `Exclusive` | one owner | everything else |
/// | `Shared` | any number of readers | exclusive and semaphore holders |
/// | `Semaphore { permits }` | at most `permits` owners | exclusive and shared holders |
///
/// # Examples
///
/// ```
/// use fencelock_core::Mode;
///
/// assert!(Mode::Shared.compatible_with(Mode::Shared));
/// assert!(!Mode::Shared.compatible_with(Mode::Exclusive));
/// assert_eq!(Mode::parse("semaphore:3")?, Mode::Semaphore { permits: 3 });
/// # Ok::<(), fencelock_core::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Mode {
    /// One holder at a time (a mutex, a write lock).
    #[default]
    Exclusive,
    /// Many readers at once; no writer while any reader holds.
    Shared,
    /// At most `permits` holders at once.
    Semaphore {
        /// How many holders may hold at once; at least 1.
        permits: u32,
    },
}

impl Mode {
    /// Whether a holder in `self` mode may hold together with one in `other` mode
    /// (ignoring the permit count of semaphores).
    pub fn compatible_with(self, other: Mode) -> bool {
        matches!(
            (self, other),
            (Mode::Shared, Mode::Shared) | (Mode::Semaphore { .. }, Mode::Semaphore { .. })
        )
    }

    /// Checks the mode's own parameters.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] for a semaphore of 0 permits.
    pub fn validate(self) -> Result<()> {
        match self {
            Mode::Semaphore { permits: 0 } => {
                Err(Error::config("a semaphore needs at least 1 permit (got 0)"))
            }
            _ => Ok(()),
        }
    }

    /// The short name stored by backends: `exclusive`, `shared` or `semaphore:N`.
    pub fn as_label(self) -> String {
        self.to_string()
    }

    /// Parses the label written by [`Mode::as_label`].
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] if the text is not a mode.
    pub fn parse(s: &str) -> Result<Mode> {
        match s {
            "exclusive" => Ok(Mode::Exclusive),
            "shared" => Ok(Mode::Shared),
            _ => {
                let permits = s
                    .strip_prefix("semaphore:")
                    .and_then(|n| n.parse::<u32>().ok())
                    .ok_or_else(|| {
                        Error::config(format!(
                            "unknown lock mode {s:?}; expected exclusive, shared or semaphore:N"
                        ))
                    })?;
                let mode = Mode::Semaphore { permits };
                mode.validate()?;
                Ok(mode)
            }
        }
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Mode::Exclusive => f.write_str("exclusive"),
            Mode::Shared => f.write_str("shared"),
            Mode::Semaphore { permits } => write!(f, "semaphore:{permits}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_round_trip() {
        for m in [
            Mode::Exclusive,
            Mode::Shared,
            Mode::Semaphore { permits: 7 },
        ] {
            assert_eq!(Mode::parse(&m.as_label()).unwrap(), m);
        }
        assert!(Mode::parse("semaphore:0").is_err());
        assert!(Mode::parse("write").is_err());
    }
}
