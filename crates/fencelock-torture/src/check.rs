//! The checks over a whole campaign's history.
//!
//! A hold's interval runs from the grant being seen to the end of its believed
//! validity (release about to be sent, `lost()` fired, or the deadline passed);
//! for a client that died holding, to its death. The times come from one wall
//! clock that every process on the machine shares, so an overlap of two such
//! intervals proves that two holders both believed they held.

use std::collections::{BTreeMap, HashMap};

use fencelock::Mode;

use crate::events::Event;
use crate::register::Write;

/// One hold as the checks see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hold {
    /// `CLIENT#N`.
    pub id: String,
    /// The key.
    pub key: String,
    /// The mode.
    pub mode: Mode,
    /// The fencing token.
    pub token: Option<u64>,
    /// Grant seen.
    pub start_ns: u128,
    /// Believed validity ended.
    pub end_ns: u128,
    /// Why it ended (`released`, `lost:…`, `expired`, `died`).
    pub reason: String,
    /// The guard was already invalid when it arrived.
    pub late: bool,
}

/// A fault as it was injected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FaultRecord {
    /// Its name (`pause`, `partition`, …).
    pub kind: String,
    /// What it hit (a client, a server member).
    pub target: String,
    /// When it began.
    pub start_ns: u128,
    /// When it healed.
    pub heal_ns: u128,
}

/// Everything the checks look at.
#[derive(Debug, Default)]
pub struct History {
    /// The clients' events, each with the client's name.
    pub events: Vec<(String, Event)>,
    /// When each client process ended (killed, or stopped at the end).
    pub gone_ns: HashMap<String, u128>,
    /// The register's writes.
    pub writes: Vec<Write>,
    /// The faults.
    pub faults: Vec<FaultRecord>,
    /// The longest TTL a client may ask for, in ns (how long a server fault's
    /// effects may last).
    pub ttl_ns: u128,
}

/// The findings.
#[derive(Debug, Default, Clone)]
pub struct Findings {
    /// Holds seen.
    pub grants: usize,
    /// Holds whose lease was lost (or expired) before release.
    pub lost: usize,
    /// Acquires that gave up after their wait.
    pub timeouts: usize,
    /// Failed acquires and releases.
    pub errors: usize,
    /// Acquires and releases the clients dropped in flight.
    pub cancelled: usize,
    /// Acquires that waited their whole wait in calm (no fault for 3 TTLs +
    /// 5 s before or during it, no cancellation on the key for 2 TTLs + 1 s) while
    /// nobody held the key, and got nothing: a ghost holder, or a lost
    /// wake-up.
    pub stuck_waits: usize,
    /// Acquires that returned more than [`LATE_BOUND`] after their wait ended
    /// while their client was not paused or frozen: a waiter held past its
    /// deadline.
    pub late_returns: usize,
    /// Pairs of incompatible holds of one key that overlapped.
    pub overlaps: usize,
    /// Moments a semaphore had more holders than permits.
    pub over_permits: usize,
    /// Grants whose token was not larger than one of a hold that ended before.
    pub token_regressions: usize,
    /// Writes the register accepted from a hold after a later-granted hold of the key had written.
    pub superseded_accepted: usize,
    /// Writes the register rejected (stale tokens: fencing at work).
    pub stale_rejected: usize,
    /// Writes the register accepted.
    pub writes_accepted: usize,
    /// Guards that were invalid on arrival.
    pub lost_on_arrival: usize,
    /// The longest time from a fault's healing to the next grant, in ms.
    pub max_recovery_ms: u64,
    /// The longest time a key had no holder, in ms.
    pub max_unavailable_ms: u64,
    /// The first few violations, described with the history lines that show them.
    pub examples: Vec<String>,
}

impl Findings {
    /// Overlaps, permits exceeded, token regressions, superseded writes, late
    /// guards, stuck waits and late returns — everything a correct lock never
    /// shows.
    pub fn violations(&self) -> usize {
        self.overlaps
            + self.over_permits
            + self.token_regressions
            + self.superseded_accepted
            + self.lost_on_arrival
            + self.unavailable()
    }

    /// The availability violations: stuck waits (a free key not granted)
    /// and late returns (a waiter held past its wait).
    pub fn unavailable(&self) -> usize {
        self.stuck_waits + self.late_returns
    }
}

const EXAMPLES: usize = 6;

/// The holds of a history, by key.
pub fn holds(h: &History) -> BTreeMap<String, Vec<Hold>> {
    let mut ends: HashMap<&str, (u128, &str)> = HashMap::new();
    for (_, e) in &h.events {
        if let Event::End {
            hold,
            end_ns,
            reason,
        } = e
        {
            ends.insert(hold, (*end_ns, reason));
        }
    }
    let mut by_key: BTreeMap<String, Vec<Hold>> = BTreeMap::new();
    for (client, e) in &h.events {
        if let Event::Grant {
            hold,
            key,
            mode,
            token,
            seen_ns,
            valid_on_arrival,
            ..
        } = e
        {
            let (end_ns, reason) = match ends.get(hold.as_str()) {
                Some((end, reason)) => (*end, reason.to_string()),
                None => (
                    h.gone_ns.get(client).copied().unwrap_or(u128::MAX),
                    "died".to_string(),
                ),
            };
            by_key.entry(key.clone()).or_default().push(Hold {
                id: hold.clone(),
                key: key.clone(),
                mode: *mode,
                token: *token,
                start_ns: *seen_ns,
                end_ns: end_ns.max(*seen_ns),
                reason,
                late: !valid_on_arrival,
            });
        }
    }
    for v in by_key.values_mut() {
        v.sort_by_key(|h| (h.start_ns, h.end_ns));
    }
    by_key
}

/// Runs every check.
pub fn check(h: &History) -> Findings {
    let by_key = holds(h);
    let t0 = h
        .events
        .iter()
        .filter_map(|(_, e)| match e {
            Event::Grant { seen_ns, .. } => Some(*seen_ns),
            _ => None,
        })
        .min()
        .unwrap_or(0);
    let mut c = Checker {
        h,
        t0,
        f: Findings::default(),
    };
    c.count_outcomes();
    for (key, holds) in &by_key {
        c.f.grants += holds.len();
        c.f.lost += holds.iter().filter(|x| x.reason != "released").count();
        for x in holds.iter().filter(|x| x.late) {
            c.f.lost_on_arrival += 1;
            c.example(format!("lost on arrival on {key}: {}", c.show(x)));
        }
        c.exclusion(key, holds);
        c.tokens(key, holds);
        c.unavailability(holds);
    }
    c.writes(&by_key);
    stuck_waits(h, &by_key, t0, &mut c.f);
    late_returns(h, t0, &mut c.f);
    c.recovery(&by_key);
    c.f
}

/// The history being checked, its first grant's time, and what was found.
struct Checker<'h> {
    h: &'h History,
    t0: u128,
    f: Findings,
}

impl Checker<'_> {
    /// Keeps `text` as an example, if there is room.
    fn example(&mut self, text: String) {
        if self.f.examples.len() < EXAMPLES {
            self.f.examples.push(text);
        }
    }

    /// A hold as an example line shows it (times from the first grant).
    fn show(&self, x: &Hold) -> String {
        format!(
            "{} {} token {} from +{} ms to +{} ms ({})",
            x.id,
            x.mode,
            x.token.map_or("-".into(), |t| t.to_string()),
            ms(x.start_ns.saturating_sub(self.t0)),
            ms(x.end_ns.saturating_sub(self.t0)),
            x.reason
        )
    }

    /// Timeouts, errors and cancellations.
    fn count_outcomes(&mut self) {
        for (_, e) in &self.h.events {
            match e {
                Event::Timeout { .. } => self.f.timeouts += 1,
                Event::Error { .. } => self.f.errors += 1,
                Event::Cancel { .. } => self.f.cancelled += 1,
                _ => {}
            }
        }
    }

    /// Exclusion and permits: a sweep over `key`'s holds in grant order.
    fn exclusion(&mut self, key: &str, holds: &[Hold]) {
        let mut active: Vec<&Hold> = Vec::new();
        for x in holds {
            active.retain(|a| a.end_ns > x.start_ns);
            for a in &active {
                if !x.mode.compatible_with(a.mode) {
                    self.f.overlaps += 1;
                    let text = format!(
                        "overlap on {key}: {} while {}{}",
                        self.show(x),
                        self.show(a),
                        faults_during(self.h, a.start_ns, x.end_ns, self.t0)
                    );
                    self.example(text);
                }
            }
            active.push(x);
            if let Mode::Semaphore { permits } = x.mode {
                let n = active
                    .iter()
                    .filter(|a| matches!(a.mode, Mode::Semaphore { .. }))
                    .count();
                if n > permits as usize {
                    self.f.over_permits += 1;
                    let text = format!(
                        "{n} holders of {permits} permits on {key}: {}",
                        self.show(x)
                    );
                    self.example(text);
                }
            }
        }
    }

    /// Tokens: larger than that of every hold of a mode it excludes that
    /// ended before the grant. Compatible holds (readers, permits) may be
    /// granted at the servers at once and seen in either order, so their
    /// tokens are not ordered among themselves.
    fn tokens(&mut self, key: &str, holds: &[Hold]) {
        for x in holds.iter().filter(|x| x.token.is_some()) {
            let before = holds
                .iter()
                .filter(|m| {
                    m.token.is_some() && m.end_ns < x.start_ns && !x.mode.compatible_with(m.mode)
                })
                .max_by_key(|m| m.token);
            if let Some(m) = before
                && x.token <= m.token
            {
                self.f.token_regressions += 1;
                let text = format!(
                    "token did not rise on {key}: {} after {}{}",
                    self.show(x),
                    self.show(m),
                    faults_during(self.h, m.start_ns, x.start_ns, self.t0)
                );
                self.example(text);
            }
        }
    }

    /// Unavailability: the longest stretch without a holder.
    fn unavailability(&mut self, holds: &[Hold]) {
        let mut covered = holds.first().map_or(0, |x| x.start_ns);
        for x in holds {
            if x.start_ns > covered {
                self.f.max_unavailable_ms = self.f.max_unavailable_ms.max(ms(x.start_ns - covered));
            }
            covered = covered.max(x.end_ns);
        }
    }

    /// Superseded writes: accepted after a later-granted hold of the key wrote.
    fn writes(&mut self, by_key: &BTreeMap<String, Vec<Hold>>) {
        let starts: HashMap<&str, u128> = by_key
            .values()
            .flatten()
            .map(|x| (x.id.as_str(), x.start_ns))
            .collect();
        let mut newest: HashMap<&str, (u128, &str)> = HashMap::new();
        for w in &self.h.writes {
            if !w.accepted {
                self.f.stale_rejected += 1;
                continue;
            }
            self.f.writes_accepted += 1;
            let start = starts.get(w.hold.as_str()).copied().unwrap_or(0);
            match newest.get(w.key.as_str()) {
                Some(&(s, by)) if s > start && by != w.hold => {
                    self.f.superseded_accepted += 1;
                    let text = format!(
                        "superseded write accepted on {}: {} (token {:?}) wrote at +{} ms after {} (granted later) had written",
                        w.key,
                        w.hold,
                        w.token,
                        ms(w.at_ns.saturating_sub(self.t0)),
                        by
                    );
                    self.example(text);
                }
                Some(&(s, _)) if s >= start => {}
                _ => {
                    newest.insert(&w.key, (start, &w.hold));
                }
            }
        }
    }

    /// Recovery: from each fault's healing to the next grant.
    fn recovery(&mut self, by_key: &BTreeMap<String, Vec<Hold>>) {
        let mut grants: Vec<u128> = by_key.values().flatten().map(|x| x.start_ns).collect();
        grants.sort_unstable();
        for fault in &self.h.faults {
            let i = grants.partition_point(|&g| g < fault.heal_ns);
            if let Some(&g) = grants.get(i) {
                self.f.max_recovery_ms = self.f.max_recovery_ms.max(ms(g - fault.heal_ns));
            }
        }
    }
}

/// The longest TTL a fault's effects may be measured in. A client does one
/// thing at a time, so its last acquire asked before a fault of it began
/// was for the hold it had or the request it had in flight: the longest of
/// that one and those asked until the fault healed. For a server fault (or
/// a client that asked nothing yet): the longest any client may ask for
/// ([`History::ttl_ns`]).
fn fault_ttl(h: &History, fault: &FaultRecord) -> u128 {
    let client = fault.target.split_whitespace().next().unwrap_or("");
    let mut before: Option<u128> = None;
    let mut during: u128 = 0;
    for (c, e) in &h.events {
        if let Event::Ask { at_ns, ttl_ns, .. } = e
            && c == client
        {
            if *at_ns <= fault.start_ns {
                before = Some(*ttl_ns);
            } else if *at_ns <= fault.heal_ns {
                during = during.max(*ttl_ns);
            }
        }
    }
    match before {
        Some(t) => t.max(during),
        None => h.ttl_ns,
    }
}

/// How long after a fault heals (or a cancellation) its effects may last: a
/// hold it orphaned expires within its server-side life (see [`life`]);
/// waiters poll or wake within another.
pub fn calm_after(ttl_ns: u128) -> u128 {
    3 * life(ttl_ns) + 5_000_000_000
}

/// The longest a hold of TTL `ttl_ns` may live on in a server after its last
/// renewal, on any backend: whole seconds, rounded up, and 2 s more
/// (memcached's items; ZooKeeper's sessions and etcd's leases count whole
/// seconds too).
pub fn life(ttl_ns: u128) -> u128 {
    const S: u128 = 1_000_000_000;
    ttl_ns.div_ceil(S) * S + 2 * S
}

/// How far past its wait an acquire may return: the library gives a backend
/// that does not answer one second past the deadline (ARCHITECTURE.md §2,
/// *Outages*); the rest is slack for a loaded machine.
pub const LATE_BOUND: std::time::Duration = std::time::Duration::from_secs(3);

/// Acquires that returned more than [`LATE_BOUND`] past their wait while
/// their client was not paused or frozen (a stopped process cannot return).
fn late_returns(h: &History, t0: u128, f: &mut Findings) {
    for (client, e) in &h.events {
        let Event::Late {
            at_ns,
            key,
            waited_ns,
            wait_ns,
        } = e
        else {
            continue;
        };
        let from = at_ns.saturating_sub(*waited_ns);
        let paused = h.faults.iter().any(|x| {
            matches!(x.kind.as_str(), "pause" | "freeze")
                && x.target == *client
                && x.start_ns <= *at_ns
                && x.heal_ns >= from
        });
        if paused {
            continue;
        }
        f.late_returns += 1;
        let text = format!(
            "late return on {key}: an acquire with a wait of {} ms returned after {} ms (+{}..+{} ms){}",
            ms(*wait_ns),
            ms(*waited_ns),
            ms(from.saturating_sub(t0)),
            ms(at_ns.saturating_sub(t0)),
            faults_during(h, from, *at_ns, t0)
        );
        if f.examples.len() < EXAMPLES {
            f.examples.push(text);
        }
    }
}

/// Timeouts of acquires that waited wholly in calm while no hold of the key
/// existed (see [`Findings::stuck_waits`]).
fn stuck_waits(h: &History, by_key: &BTreeMap<String, Vec<Hold>>, t0: u128, f: &mut Findings) {
    let storms: Vec<(u128, u128)> = h
        .faults
        .iter()
        .map(|x| (x.start_ns, x.heal_ns + calm_after(fault_ttl(h, x))))
        .collect();
    // A cancelled acquire or release may leave a hold of its key that
    // nobody knows of, for its TTL.
    let cancels: Vec<(&str, u128, u128)> = h
        .events
        .iter()
        .filter_map(|(_, e)| match e {
            Event::Cancel {
                at_ns, key, ttl_ns, ..
            } => Some((key.as_str(), *at_ns, 2 * life(*ttl_ns) + 1_000_000_000)),
            _ => None,
        })
        .collect();
    for (_, e) in &h.events {
        let Event::Timeout {
            at_ns,
            key,
            waited_ns,
        } = e
        else {
            continue;
        };
        let from = at_ns.saturating_sub(*waited_ns);
        let stormy = storms.iter().any(|&(s, e)| s <= *at_ns && e >= from)
            || cancels
                .iter()
                .any(|&(k, c, after)| k == key && c <= *at_ns && c + after >= from);
        let held = by_key.get(key).is_some_and(|holds| {
            holds
                .iter()
                .any(|x| x.start_ns <= *at_ns && x.end_ns >= from)
        });
        if !stormy && !held {
            f.stuck_waits += 1;
            let text = format!(
                "stuck wait on {key}: an acquire waited +{}..+{} ms in calm while nobody held it, and got nothing",
                ms(from.saturating_sub(t0)),
                ms(at_ns.saturating_sub(t0))
            );
            if f.examples.len() < EXAMPLES {
                f.examples.push(text);
            }
        }
    }
}

fn ms(ns: u128) -> u64 {
    u64::try_from(ns / 1_000_000).unwrap_or(u64::MAX)
}

/// ` (faults then: …)` for the faults active between `from` and `to`.
fn faults_during(h: &History, from: u128, to: u128, t0: u128) -> String {
    let active: Vec<String> = h
        .faults
        .iter()
        .filter(|x| x.start_ns <= to && x.heal_ns >= from)
        .map(|x| {
            format!(
                "{} of {} +{}..+{} ms",
                x.kind,
                x.target,
                ms(x.start_ns.saturating_sub(t0)),
                ms(x.heal_ns.saturating_sub(t0))
            )
        })
        .collect();
    if active.is_empty() {
        String::new()
    } else {
        format!(" (faults then: {})", active.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grant(hold: &str, key: &str, mode: Mode, token: u64, seen: u128) -> (String, Event) {
        let client = hold.split('#').next().unwrap_or("").to_string();
        (
            client,
            Event::Grant {
                hold: hold.into(),
                key: key.into(),
                mode,
                token: Some(token),
                seen_ns: seen,
                valid_ns: seen + 100,
                valid_on_arrival: true,
            },
        )
    }

    fn end(hold: &str, at: u128) -> (String, Event) {
        let client = hold.split('#').next().unwrap_or("").to_string();
        (
            client,
            Event::End {
                hold: hold.into(),
                end_ns: at,
                reason: "released".into(),
            },
        )
    }

    fn write(hold: &str, token: u64, at: u128, accepted: bool) -> Write {
        Write {
            at_ns: at,
            key: "k".into(),
            token: Some(token),
            hold: hold.into(),
            accepted,
        }
    }

    #[test]
    fn a_clean_history_has_no_violation() {
        let h = History {
            events: vec![
                grant("a#1", "k", Mode::Exclusive, 1, 0),
                end("a#1", 10),
                grant("b#1", "k", Mode::Exclusive, 2, 11),
                end("b#1", 20),
                grant("r#1", "rw", Mode::Shared, 1, 0),
                grant("s#1", "rw", Mode::Shared, 2, 5),
                end("r#1", 10),
                end("s#1", 12),
            ],
            writes: vec![write("a#1", 1, 5, true), write("b#1", 2, 15, true)],
            ..History::default()
        };
        let f = check(&h);
        assert_eq!((f.grants, f.violations()), (4, 0), "{:?}", f.examples);
    }

    #[test]
    fn overlaps_regressions_and_superseded_writes_are_counted() {
        let h = History {
            events: vec![
                grant("a#1", "k", Mode::Exclusive, 5, 0),
                end("a#1", 10),
                grant("b#1", "k", Mode::Exclusive, 3, 5), // overlaps a, and token went back
                end("b#1", 20),
                grant("c#1", "k", Mode::Exclusive, 4, 30), // after b (3) ended: fine; after a (5): not
            ],
            gone_ns: HashMap::from([("c".to_string(), 40)]),
            writes: vec![
                write("b#1", 3, 6, true), // with no fencing register in between
                write("a#1", 5, 8, true), // a was granted earlier than b, which wrote: superseded
                write("c#1", 4, 31, false),
            ],
            ..History::default()
        };
        let f = check(&h);
        assert_eq!(f.overlaps, 1, "{:?}", f.examples);
        assert_eq!(f.token_regressions, 1, "{:?}", f.examples);
        assert_eq!(f.superseded_accepted, 1, "{:?}", f.examples);
        assert_eq!(f.stale_rejected, 1);
        assert_eq!(
            holds(&h)["k"][2].end_ns,
            40,
            "a dead client's hold ends at its death"
        );
    }

    #[test]
    fn semaphores_may_not_exceed_their_permits() {
        let s = Mode::Semaphore { permits: 2 };
        let h = History {
            events: vec![
                grant("a#1", "s", s, 1, 0),
                grant("b#1", "s", s, 2, 1),
                grant("c#1", "s", s, 3, 2),
                end("a#1", 10),
                end("b#1", 10),
                end("c#1", 10),
            ],
            ..History::default()
        };
        assert_eq!(check(&h).over_permits, 1);
    }

    #[test]
    fn a_wait_in_calm_on_a_free_key_that_gets_nothing_is_stuck() {
        const S: u128 = 1_000_000_000;
        let timeout = |at: u128, waited: u128| {
            (
                "w".to_string(),
                Event::Timeout {
                    at_ns: at * S,
                    key: "k".into(),
                    waited_ns: waited * S,
                },
            )
        };
        let mut h = History {
            events: vec![
                grant("a#1", "k", Mode::Exclusive, 1, 0),
                end("a#1", 10 * S),
                // Waited while a held: not stuck.
                timeout(12, 4),
                // Waited with nobody holding, long after everything: stuck.
                timeout(30, 4),
            ],
            ttl_ns: S,
            ..History::default()
        };
        let f = check(&h);
        assert_eq!(f.stuck_waits, 1, "{:?}", f.examples);
        // A fault that healed less than 3 TTLs + 5 s before may explain it.
        h.faults.push(FaultRecord {
            kind: "pause".into(),
            target: "a".into(),
            start_ns: 20 * S,
            heal_ns: 21 * S,
        });
        assert_eq!(check(&h).stuck_waits, 0);
        // So may a cancellation less than 2 TTLs + 1 s before.
        h.faults.clear();
        h.events.push((
            "c".into(),
            Event::Cancel {
                at_ns: 24 * S,
                key: "k".into(),
                what: "acquire".into(),
                ttl_ns: S,
            },
        ));
        assert_eq!(check(&h).stuck_waits, 0);
    }

    /// With a TTL under a second, a cancelled acquire's hold may live on in
    /// memcached for a whole second and 2 more: a wait behind it is not stuck.
    #[test]
    fn a_short_ttls_window_covers_the_holds_life_in_the_server() {
        const MS: u128 = 1_000_000;
        let h = History {
            events: vec![
                (
                    "c".into(),
                    Event::Cancel {
                        at_ns: 10_000 * MS,
                        key: "k".into(),
                        what: "acquire".into(),
                        ttl_ns: 500 * MS,
                    },
                ),
                (
                    "w".into(),
                    Event::Timeout {
                        at_ns: 13_000 * MS,
                        key: "k".into(),
                        waited_ns: 500 * MS,
                    },
                ),
            ],
            ttl_ns: 500 * MS,
            ..History::default()
        };
        let f = check(&h);
        assert_eq!(f.stuck_waits, 0, "{:?}", f.examples);
    }

    #[test]
    fn an_acquire_returning_long_after_its_wait_is_late_unless_its_client_was_paused() {
        const S: u128 = 1_000_000_000;
        let mut h = History {
            events: vec![(
                "w".into(),
                Event::Late {
                    at_ns: 20 * S,
                    key: "k".into(),
                    waited_ns: 10 * S,
                    wait_ns: 2 * S,
                },
            )],
            ttl_ns: S,
            ..History::default()
        };
        let f = check(&h);
        assert_eq!(
            (f.late_returns, f.unavailable()),
            (1, 1),
            "{:?}",
            f.examples
        );
        assert_eq!(f.violations(), 1);
        // Another client's pause does not excuse it; its own does.
        for (target, late) in [("x", 1), ("w", 0)] {
            h.faults = vec![FaultRecord {
                kind: "pause".into(),
                target: target.into(),
                start_ns: 12 * S,
                heal_ns: 18 * S,
            }];
            assert_eq!(check(&h).late_returns, late, "pause of {target}");
        }
    }

    /// A fault of a client is measured in the TTL of what it held or asked
    /// for then, not in the longest TTL any client may ask for.
    #[test]
    fn a_client_faults_window_is_measured_in_its_own_ttl() {
        const S: u128 = 1_000_000_000;
        let history = |asked: u128| History {
            events: vec![
                (
                    "c".into(),
                    Event::Ask {
                        at_ns: 0,
                        key: "k".into(),
                        ttl_ns: asked * S,
                    },
                ),
                grant("c#1", "k", Mode::Exclusive, 1, S),
                end("c#1", 3 * S),
                (
                    "w".into(),
                    Event::Timeout {
                        at_ns: 30 * S,
                        key: "k".into(),
                        waited_ns: 4 * S,
                    },
                ),
            ],
            faults: vec![FaultRecord {
                kind: "pause".into(),
                target: "c".into(),
                start_ns: 2 * S,
                heal_ns: 3 * S,
            }],
            ttl_ns: 8 * S,
            ..History::default()
        };
        // Its hold of 8 s may outlive the pause by 3 lives + 5 s: excused.
        assert_eq!(check(&history(8)).stuck_waits, 0);
        // One of 1 s cannot explain a wait 23 s after the pause healed.
        assert_eq!(check(&history(1)).stuck_waits, 1);
    }

    #[test]
    fn tokens_are_ordered_against_the_modes_a_hold_excludes() {
        let h = History {
            events: vec![
                grant("a#1", "rw", Mode::Shared, 5, 0),
                end("a#1", 10),
                // A reader seen later with a lower token: both readers may
                // have been granted at once.
                grant("b#1", "rw", Mode::Shared, 4, 11),
                end("b#1", 20),
                // A writer after them must be above both.
                grant("c#1", "rw", Mode::Exclusive, 5, 21),
                end("c#1", 30),
            ],
            ..History::default()
        };
        let f = check(&h);
        assert_eq!(f.token_regressions, 1, "{:?}", f.examples);
        assert!(f.examples[0].contains("c#1"), "{:?}", f.examples);
    }
}
