//! The lines a client prints, one per event, and their parsing.
//!
//! - `G HOLD KEY MODE TOKEN|- SEEN_NS VALID_NS ok|late` — a grant was seen at
//!   `SEEN_NS`; its conservative local deadline was `VALID_NS`; `late` if the
//!   guard was no longer valid when it arrived;
//! - `E HOLD END_NS REASON` — the hold's believed validity ended: the release
//!   was about to be sent, or `lost()` fired, or the deadline passed — the
//!   earliest of them (`END_NS` ≤ the deadline as last known);
//! - `T NS KEY WAITED_NS` — an acquire of `KEY` gave up after waiting
//!   `WAITED_NS`;
//! - `A NS KEY TTL_NS` — an acquire of `KEY` with a TTL of `TTL_NS` was
//!   asked (each acquire draws its TTL);
//! - `C NS KEY acquire|release TTL_NS` — the client dropped an acquire or a
//!   release of `KEY`, of a hold with a TTL of `TTL_NS`, while it was in
//!   flight (cancellation);
//! - `L NS KEY WAITED_NS WAIT_NS` — an acquire of `KEY` with a wait of
//!   `WAIT_NS` returned (granted, timed out or failed) only after `WAITED_NS`,
//!   more than [`crate::check::LATE_BOUND`] past its wait;
//! - `X NS TEXT…` — an acquire or release failed otherwise.
//!
//! Times are nanoseconds of the shared wall clock ([`fencelock::Hold::now_ns`]),
//! which the clock-offset fault does not shift.

use fencelock::Mode;

/// One parsed line.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Event {
    /// A grant was seen.
    Grant {
        /// `CLIENT#N`.
        hold: String,
        /// The key.
        key: String,
        /// The mode.
        mode: Mode,
        /// The fencing token.
        token: Option<u64>,
        /// When the grant was seen.
        seen_ns: u128,
        /// The guard's deadline at arrival.
        valid_ns: u128,
        /// Whether the guard was valid when it arrived.
        valid_on_arrival: bool,
    },
    /// The hold's believed validity ended.
    End {
        /// `CLIENT#N`.
        hold: String,
        /// When.
        end_ns: u128,
        /// `released`, `lost:…`, `expired`.
        reason: String,
    },
    /// An acquire timed out.
    Timeout {
        /// When.
        at_ns: u128,
        /// The key.
        key: String,
        /// How long it waited.
        waited_ns: u128,
    },
    /// An acquire was asked.
    Ask {
        /// When.
        at_ns: u128,
        /// The key.
        key: String,
        /// The TTL asked for.
        ttl_ns: u128,
    },
    /// The client dropped an operation in flight.
    Cancel {
        /// When.
        at_ns: u128,
        /// The key.
        key: String,
        /// `acquire` or `release`.
        what: String,
        /// The TTL of the hold it was for.
        ttl_ns: u128,
    },
    /// An acquire returned long after its wait had ended.
    Late {
        /// When it returned.
        at_ns: u128,
        /// The key.
        key: String,
        /// How long it took.
        waited_ns: u128,
        /// The wait it was given.
        wait_ns: u128,
    },
    /// An operation failed.
    Error {
        /// When.
        at_ns: u128,
        /// What failed.
        text: String,
    },
}

impl Event {
    /// The line for this event.
    pub fn to_line(&self) -> String {
        match self {
            Event::Grant {
                hold,
                key,
                mode,
                token,
                seen_ns,
                valid_ns,
                valid_on_arrival,
            } => format!(
                "G {hold} {key} {mode} {} {seen_ns} {valid_ns} {}",
                token.map_or("-".into(), |t| t.to_string()),
                if *valid_on_arrival { "ok" } else { "late" }
            ),
            Event::End {
                hold,
                end_ns,
                reason,
            } => format!(
                "E {hold} {end_ns} {}",
                reason.replace(char::is_whitespace, "_")
            ),
            Event::Timeout {
                at_ns,
                key,
                waited_ns,
            } => format!("T {at_ns} {key} {waited_ns}"),
            Event::Ask { at_ns, key, ttl_ns } => format!("A {at_ns} {key} {ttl_ns}"),
            Event::Cancel {
                at_ns,
                key,
                what,
                ttl_ns,
            } => format!("C {at_ns} {key} {what} {ttl_ns}"),
            Event::Late {
                at_ns,
                key,
                waited_ns,
                wait_ns,
            } => format!("L {at_ns} {key} {waited_ns} {wait_ns}"),
            Event::Error { at_ns, text } => format!("X {at_ns} {}", text.replace('\n', " ")),
        }
    }

    /// Parses [`Event::to_line`]; `None` for anything else (a client's stray output).
    pub fn parse(line: &str) -> Option<Event> {
        let mut p = line.split_whitespace();
        match p.next()? {
            "G" => {
                let hold = p.next()?.to_string();
                let key = p.next()?.to_string();
                let mode = Mode::parse(p.next()?).ok()?;
                let token = match p.next()? {
                    "-" => None,
                    t => Some(t.parse().ok()?),
                };
                let seen_ns = p.next()?.parse().ok()?;
                let valid_ns = p.next()?.parse().ok()?;
                let valid_on_arrival = p.next()? == "ok";
                Some(Event::Grant {
                    hold,
                    key,
                    mode,
                    token,
                    seen_ns,
                    valid_ns,
                    valid_on_arrival,
                })
            }
            "E" => Some(Event::End {
                hold: p.next()?.to_string(),
                end_ns: p.next()?.parse().ok()?,
                reason: p.next()?.to_string(),
            }),
            "T" => Some(Event::Timeout {
                at_ns: p.next()?.parse().ok()?,
                key: p.next()?.to_string(),
                waited_ns: p.next()?.parse().ok()?,
            }),
            "A" => Some(Event::Ask {
                at_ns: p.next()?.parse().ok()?,
                key: p.next()?.to_string(),
                ttl_ns: p.next()?.parse().ok()?,
            }),
            "C" => Some(Event::Cancel {
                at_ns: p.next()?.parse().ok()?,
                key: p.next()?.to_string(),
                what: p.next()?.to_string(),
                ttl_ns: p.next()?.parse().ok()?,
            }),
            "L" => Some(Event::Late {
                at_ns: p.next()?.parse().ok()?,
                key: p.next()?.to_string(),
                waited_ns: p.next()?.parse().ok()?,
                wait_ns: p.next()?.parse().ok()?,
            }),
            "X" => {
                let at_ns = p.next()?.parse().ok()?;
                Some(Event::Error {
                    at_ns,
                    text: p.collect::<Vec<_>>().join(" "),
                })
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_round_trip() {
        let events = [
            Event::Grant {
                hold: "c1#4".into(),
                key: "t/x".into(),
                mode: Mode::Semaphore { permits: 2 },
                token: Some(17),
                seen_ns: 10,
                valid_ns: 20,
                valid_on_arrival: false,
            },
            Event::Grant {
                hold: "c2#1".into(),
                key: "t/x".into(),
                mode: Mode::Exclusive,
                token: None,
                seen_ns: 1,
                valid_ns: 2,
                valid_on_arrival: true,
            },
            Event::End {
                hold: "c1#4".into(),
                end_ns: 15,
                reason: "lost:renewal_refused".into(),
            },
            Event::Timeout {
                at_ns: 3,
                key: "t/x".into(),
                waited_ns: 7,
            },
            Event::Cancel {
                at_ns: 5,
                key: "t/rw".into(),
                what: "release".into(),
                ttl_ns: 6,
            },
            Event::Ask {
                at_ns: 5,
                key: "t/x".into(),
                ttl_ns: 2_000_000_000,
            },
            Event::Late {
                at_ns: 9,
                key: "t/sem".into(),
                waited_ns: 8,
                wait_ns: 2,
            },
            Event::Error {
                at_ns: 4,
                text: "connection refused".into(),
            },
        ];
        for e in events {
            assert_eq!(Event::parse(&e.to_line()), Some(e));
        }
        assert_eq!(Event::parse("acquired 5"), None);
    }
}
