//! The history checker: did a lock really exclude, and did tokens really rise?

use std::fmt;

use crate::mode::Mode;

/// One hold as a client observed it.
///
/// `acquired_ns` is read **after** the grant returned and `released_ns`
/// **before** the release was sent (or when the hold was known lost), both from
/// one clock shared by every participant (the wall clock serves for processes on
/// one machine). The observed interval then lies inside the real one, so an
/// overlap of observed intervals proves the lock failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hold {
    /// Who held (a worker name).
    pub holder: String,
    /// In which mode.
    pub mode: Mode,
    /// The fencing token, if the backend gives one.
    pub token: Option<u64>,
    /// When the grant was seen, in nanoseconds of the shared clock.
    pub acquired_ns: u128,
    /// When the hold ended, in nanoseconds of the shared clock.
    pub released_ns: u128,
}

impl Hold {
    /// The shared clock: nanoseconds since the Unix epoch.
    pub fn now_ns() -> u128 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0)
    }

    /// One line of text (`holder mode token acquired released`), for histories
    /// that several processes write to files.
    pub fn to_line(&self) -> String {
        format!(
            "{} {} {} {} {}",
            self.holder,
            self.mode,
            self.token.map_or("-".to_string(), |t| t.to_string()),
            self.acquired_ns,
            self.released_ns
        )
    }

    /// Parses [`Hold::to_line`]; `None` for a malformed line.
    pub fn from_line(line: &str) -> Option<Hold> {
        let mut parts = line.split_whitespace();
        let holder = parts.next()?.to_string();
        let mode = Mode::parse(parts.next()?).ok()?;
        let token = match parts.next()? {
            "-" => None,
            t => Some(t.parse().ok()?),
        };
        let acquired_ns = parts.next()?.parse().ok()?;
        let released_ns = parts.next()?.parse().ok()?;
        Some(Hold {
            holder,
            mode,
            token,
            acquired_ns,
            released_ns,
        })
    }
}

/// A broken promise found in a history.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Violation {
    /// Two holds that must exclude each other overlapped.
    Overlap {
        /// The earlier hold.
        first: Box<Hold>,
        /// The hold granted while `first` was held.
        second: Box<Hold>,
    },
    /// More semaphore holders at once than permits.
    TooManyHolders {
        /// The hold that made one too many.
        hold: Box<Hold>,
        /// How many held at once with it.
        holding: usize,
    },
    /// A hold that began after another ended got a token that is not larger.
    TokenNotIncreasing {
        /// The hold that ended first.
        earlier: Box<Hold>,
        /// The later hold, whose token is not larger.
        later: Box<Hold>,
    },
    /// A hold ends before it begins (a recording bug).
    Malformed(Box<Hold>),
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Violation::Overlap { first, second } => write!(
                f,
                "holds overlap: {} ({}) was granted at {} while {} ({}) held it until {}",
                second.holder,
                second.mode,
                second.acquired_ns,
                first.holder,
                first.mode,
                first.released_ns
            ),
            Violation::TooManyHolders { hold, holding } => {
                write!(f, "{} made {holding} holders of {}", hold.holder, hold.mode)
            }
            Violation::TokenNotIncreasing { earlier, later } => write!(
                f,
                "token did not increase: {} got {:?} after {} held with {:?}",
                later.holder, later.token, earlier.holder, earlier.token
            ),
            Violation::Malformed(h) => write!(f, "hold of {} ends before it begins", h.holder),
        }
    }
}

impl std::error::Error for Violation {}

/// What a correct history looked like.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HistorySummary {
    /// Holds checked.
    pub holds: usize,
    /// The most holds at once.
    pub max_concurrent: usize,
    /// Consecutive grants (in grant order) that went to a different holder.
    pub owner_switches: usize,
}

/// Checks a history of holds of **one key**:
///
/// 1. no two holds overlap unless their modes allow it (shared with shared,
///    semaphore with semaphore up to its permits);
/// 2. tokens strictly increase in grant order: a hold that began after another
///    ended has a larger token (holds without a token are not compared).
///
/// # Errors
///
/// The first [`Violation`] found.
///
/// # Examples
///
/// ```
/// use fencelock_core::{check_history, Hold, Mode, Violation};
///
/// let hold = |holder: &str, token, a, r| Hold {
///     holder: holder.into(), mode: Mode::Exclusive, token: Some(token), acquired_ns: a, released_ns: r,
/// };
/// let ok = [hold("a", 1, 0, 10), hold("b", 2, 11, 20)];
/// assert_eq!(check_history(&ok)?.owner_switches, 1);
///
/// let overlap = [hold("a", 1, 0, 10), hold("b", 2, 5, 20)];
/// assert!(matches!(check_history(&overlap), Err(Violation::Overlap { .. })));
///
/// let stale = [hold("a", 2, 0, 10), hold("b", 1, 11, 20)];
/// assert!(matches!(check_history(&stale), Err(Violation::TokenNotIncreasing { .. })));
/// # Ok::<(), Violation>(())
/// ```
pub fn check_history(holds: &[Hold]) -> Result<HistorySummary, Violation> {
    if let Some(h) = holds.iter().find(|h| h.released_ns < h.acquired_ns) {
        return Err(Violation::Malformed(Box::new(h.clone())));
    }
    let mut by_acq: Vec<&Hold> = holds.iter().collect();
    by_acq.sort_by_key(|h| (h.acquired_ns, h.released_ns));

    // 1. Exclusion: sweep in grant order, keeping the holds still active.
    let mut active: Vec<&Hold> = Vec::new();
    let mut max_concurrent = 0;
    for &h in &by_acq {
        active.retain(|a| a.released_ns > h.acquired_ns);
        for &a in &active {
            if !h.mode.compatible_with(a.mode) {
                return Err(Violation::Overlap {
                    first: Box::new(a.clone()),
                    second: Box::new(h.clone()),
                });
            }
        }
        active.push(h);
        if let Mode::Semaphore { permits } = h.mode
            && active.len() > permits as usize
        {
            return Err(Violation::TooManyHolders {
                hold: Box::new(h.clone()),
                holding: active.len(),
            });
        }
        max_concurrent = max_concurrent.max(active.len());
    }

    // 2. Tokens: every hold that ended before `h` began has a smaller token.
    let mut by_rel: Vec<&Hold> = holds.iter().filter(|h| h.token.is_some()).collect();
    by_rel.sort_by_key(|h| h.released_ns);
    let mut ended = 0;
    let mut max_ended: Option<&Hold> = None;
    for &h in by_acq.iter().filter(|h| h.token.is_some()) {
        while ended < by_rel.len() && by_rel[ended].released_ns < h.acquired_ns {
            let e = by_rel[ended];
            if max_ended.is_none_or(|m| e.token > m.token) {
                max_ended = Some(e);
            }
            ended += 1;
        }
        if let Some(m) = max_ended
            && h.token <= m.token
        {
            return Err(Violation::TokenNotIncreasing {
                earlier: Box::new(m.clone()),
                later: Box::new(h.clone()),
            });
        }
    }

    let owner_switches = by_acq
        .windows(2)
        .filter(|w| w[0].holder != w[1].holder)
        .count();
    Ok(HistorySummary {
        holds: holds.len(),
        max_concurrent,
        owner_switches,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(holder: &str, mode: Mode, token: u64, a: u128, r: u128) -> Hold {
        Hold {
            holder: holder.into(),
            mode,
            token: Some(token),
            acquired_ns: a,
            released_ns: r,
        }
    }

    #[test]
    fn readers_may_overlap_but_not_with_a_writer() {
        let ok = [
            h("r1", Mode::Shared, 1, 0, 10),
            h("r2", Mode::Shared, 2, 5, 15),
            h("w", Mode::Exclusive, 3, 16, 20),
        ];
        assert_eq!(check_history(&ok).unwrap().max_concurrent, 2);
        let bad = [
            h("r1", Mode::Shared, 1, 0, 10),
            h("w", Mode::Exclusive, 2, 5, 15),
        ];
        assert!(check_history(&bad).is_err());
    }

    #[test]
    fn semaphore_permits() {
        let s = Mode::Semaphore { permits: 2 };
        let ok = [
            h("a", s, 1, 0, 10),
            h("b", s, 2, 1, 10),
            h("c", s, 3, 11, 12),
        ];
        assert!(check_history(&ok).is_ok());
        let bad = [
            h("a", s, 1, 0, 10),
            h("b", s, 2, 1, 10),
            h("c", s, 3, 2, 12),
        ];
        assert!(matches!(
            check_history(&bad),
            Err(Violation::TooManyHolders { holding: 3, .. })
        ));
    }

    #[test]
    fn token_compared_with_the_largest_ended_before() {
        // c begins after a (token 5) ended; b (token 2) ended too; c's token 4 < 5.
        let bad = [
            h("a", Mode::Shared, 5, 0, 3),
            h("b", Mode::Shared, 2, 1, 4),
            h("c", Mode::Shared, 4, 6, 9),
        ];
        assert!(matches!(
            check_history(&bad),
            Err(Violation::TokenNotIncreasing { .. })
        ));
    }

    #[test]
    fn lines_round_trip() {
        let x = h("w-1", Mode::Semaphore { permits: 3 }, 9, 100, 200);
        assert_eq!(Hold::from_line(&x.to_line()), Some(x));
        let none = Hold {
            token: None,
            ..h("w", Mode::Exclusive, 0, 1, 2)
        };
        assert_eq!(Hold::from_line(&none.to_line()), Some(none));
        assert_eq!(Hold::from_line("garbage"), None);
    }
}
