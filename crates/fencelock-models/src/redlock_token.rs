//! The Redlock fencing token: a quorum max-register floored at the instances'
//! clocks.
//!
//! Abstracts `crates/fencelock-redis/src/redlock/` — `RedlockBackend::acquire`
//! and `attempt` (`rounds.rs`: a round to every instance, decided on a
//! majority), `propose` and `observe` (`token.rs`:
//! the proposal from the latest instance clock reading), `settle_token` (the
//! largest answer, written back with `RAISE_FENCE` when the answers differ) —
//! and the Lua `mint` in `crates/fencelock-redis/src/scripts.rs`
//! (`max(F + 1, instance clock, proposal)`).
//!
//! # The model
//!
//! Real time advances in ticks (a tick stands for one second; instance clocks
//! count [`UNITS_PER_TICK`] units per tick, a unit standing for 10 ms). Each
//! instance has a fence `F`, at most one holder, a clock that runs
//! [`RedlockToken::offsets`] units ahead of real time, and may crash losing
//! its data (one that keeps it is, to the clients, one whose requests are
//! lost). A client's acquire round is one step (see [`Action`]): each request
//! arrives, is lost on the way, or is run with its reply lost; the client
//! decides on a majority of grants, and writes the largest answer back (a
//! step of its own) when the answers differ. A holder's validity can end at
//! any moment (a pause, an expiry); an instance's key expires only once its
//! holder's acquire is no longer live (the drift assumption: instance TTLs
//! outlast the client's validity).
//!
//! The timing assumptions the module docs of `redlock/mod.rs` state are steps the
//! model only allows under them: instance clocks never step back (they follow
//! real time), and an instance that lost its data comes back no sooner than
//! [`RedlockToken::down_ticks`] (for tokens: more than the instances' clock
//! difference plus the proposal margin) and only once every hold live when it
//! went down has ended (for exclusion: a TTL).
//!
//! # Properties
//!
//! - *always* `tokens of successive grants rise`: a grant's token is larger
//!   than that of every grant completed before its acquire began;
//! - *always* `one valid holder at most`;
//! - *sometimes* `a grant`, and *sometimes* `a grant after an instance came back
//!   empty` (the model is not vacuous, and reaches the case that matters).
//!
//! # Left out
//!
//! Reentrancy, shared mode, handoff and the local line; releases and undo
//! (keys are left to expire, the worst case of a lost release); requests of an
//! earlier acquire still in flight when the same client starts the next one
//! (a client starts only once its earlier messages are settled).

use stateright::{Model, Property};

/// Instance clock units per tick of real time.
pub const UNITS_PER_TICK: u32 = 100;

/// The proposal margin above the latest instance clock reading
/// (`PROPOSAL_MARGIN`, 100 ms), in units.
pub const MARGIN: u32 = 10;

/// Where a client's proposal comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Proposal {
    /// Today's `propose()`: the latest instance clock reading this client got,
    /// plus the time since, plus [`MARGIN`]; 0 without a reading of the last
    /// tick.
    InstanceClocks,
    /// The variant the review found (issue 11, item 1): the client's own
    /// clock plus one second. A client's clock may be ahead by
    /// [`RedlockToken::client_ahead`] ticks.
    ClientClock,
}

/// The model's parameters (its bounds).
#[derive(Clone, Debug)]
pub struct RedlockToken {
    /// Instances (at most 8).
    pub instances: usize,
    /// Clients.
    pub clients: usize,
    /// Acquires each client may start.
    pub attempts: Vec<u8>,
    /// Ticks of real time.
    pub max_time: u8,
    /// Instance crashes in all.
    pub crashes: u8,
    /// How long an instance that lost its data stays down, in ticks.
    pub down_ticks: u8,
    /// Each instance's clock offset, in units (ahead of real time).
    pub offsets: Vec<u32>,
    /// How far each client's clock is ahead, in ticks (only
    /// [`Proposal::ClientClock`] reads it).
    pub client_ahead: Vec<u8>,
    /// The proposal rule.
    pub proposal: Proposal,
    /// Whether a request can run with its reply lost (else it arrives or not).
    pub lost_replies: bool,
}

impl RedlockToken {
    /// `instances` instances (the first one's clock 100 ms ahead), two
    /// clients (the first one's clock 2 s ahead; one acquire for it, two for
    /// the other), two ticks of real time, `crashes` crashes, an emptied
    /// instance down for a tick (more than the instances' clock difference
    /// plus the margin), lost replies.
    pub fn new(instances: usize, crashes: u8, proposal: Proposal) -> Self {
        let mut offsets = vec![0; instances];
        offsets[0] = MARGIN;
        RedlockToken {
            instances,
            clients: 2,
            attempts: vec![1, 2],
            max_time: 2,
            crashes,
            down_ticks: 1,
            offsets,
            client_ahead: vec![2, 0],
            proposal,
            lost_replies: true,
        }
    }

    fn majority(&self) -> u32 {
        (self.instances / 2 + 1) as u32
    }

    fn all(&self) -> u8 {
        ((1u16 << self.instances) - 1) as u8
    }

    fn clock(&self, s: &State, i: usize) -> u32 {
        u32::from(s.now) * UNITS_PER_TICK + self.offsets[i]
    }

    fn propose(&self, s: &State, c: usize) -> u32 {
        match self.proposal {
            Proposal::InstanceClocks => match s.clients[c].reading {
                Some((v, at)) if s.now - at <= 1 => {
                    v + u32::from(s.now - at) * UNITS_PER_TICK + MARGIN
                }
                _ => 0,
            },
            Proposal::ClientClock => {
                u32::from(s.now + self.client_ahead[c]) * UNITS_PER_TICK + UNITS_PER_TICK
            }
        }
    }
}

/// What a client is doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Phase {
    /// Not acquiring, not holding.
    Idle,
    /// A majority granted with different answers: the largest, `hi`, is to be
    /// written back.
    Raising {
        /// The largest answer.
        hi: u32,
    },
    /// Holding with this token, believed valid.
    Holding(u32),
}

/// One instance.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Instance {
    /// Running.
    pub up: bool,
    /// The fence `F`.
    pub fence: u32,
    /// The holder: client and acquire number.
    pub holder: Option<(u8, u8)>,
    /// When it went down.
    pub down_since: u8,
    /// Down (after losing its data): the holds live then (client, acquire),
    /// which must end before it comes back.
    pub emptied: Option<Vec<(u8, u8)>>,
    /// It came back after losing its data.
    pub came_back_empty: bool,
}

/// One client.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Client {
    /// What it is doing.
    pub phase: Phase,
    /// Acquires started.
    pub epoch: u8,
    /// The largest token granted before this acquire began.
    pub floor: u32,
    /// The latest instance clock reading and when it came (`observe`).
    pub reading: Option<(u32, u8)>,
}

/// The whole system.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct State {
    /// Real time, in ticks.
    pub now: u8,
    /// The instances.
    pub instances: Vec<Instance>,
    /// The clients.
    pub clients: Vec<Client>,
    /// Crashes so far.
    pub crashes: u8,
    /// The largest token granted so far.
    pub granted_max: u32,
    /// Grants so far.
    pub grants: u8,
    /// A grant whose token was not larger than an earlier grant's.
    pub regression: bool,
    /// A grant happened while an instance that had lost its data was back.
    pub granted_after_empty: bool,
}

impl State {
    fn live(&self, (c, e): (u8, u8)) -> bool {
        let cl = &self.clients[c as usize];
        cl.epoch == e && cl.phase != Phase::Idle
    }
}

/// What became of one request of a round.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fate {
    /// Lost on the way, or the instance is down.
    Lost,
    /// Run by the instance; the reply arrived.
    Answered,
    /// Run by the instance; the reply was lost.
    ReplyLost,
}

/// A step.
///
/// An acquire's round is one step: the client sends to every instance, each
/// request meets a [`Fate`], the client decides. This loses no interleaving
/// the token property depends on: it compares only grants that follow each
/// other in real time, and requests of a round arriving later would only
/// raise fences. The write-back of a round whose answers differ is a step of
/// its own, so other clients' rounds, crashes and time can come in between.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// Real time advances a tick.
    Tick,
    /// Client `c` runs an acquire round with these fates, one per instance.
    Acquire(u8, Vec<Fate>),
    /// Client `c` writes its largest answer back; it reaches (and is
    /// acknowledged by) the instances in the mask.
    Raise(u8, u8),
    /// Client `c`'s hold ends (released, paused past it, expired).
    End(u8),
    /// Instance `i`'s key expires (its holder's acquire is over).
    Expire(u8),
    /// Instance `i` crashes and loses its data. (One that keeps its data is
    /// the same, for the clients, as one whose requests are lost.)
    Crash(u8),
    /// Instance `i` comes back.
    Recover(u8),
}

impl RedlockToken {
    /// Instance `i` runs client `c`'s acquire: the answer if it granted, and
    /// the clock it read.
    fn run_acquire(&self, s: &mut State, c: usize, i: usize, proposal: u32) -> (Option<u32>, u32) {
        let clock = self.clock(s, i);
        let me = (c as u8, s.clients[c].epoch);
        let inst = &mut s.instances[i];
        match inst.holder {
            Some(h) if h != me => (None, clock),
            Some(_) => (Some(inst.fence), clock),
            None => {
                let token = (inst.fence + 1).max(clock).max(proposal);
                inst.fence = token;
                inst.holder = Some(me);
                (Some(token), clock)
            }
        }
    }

    fn grant(&self, s: &mut State, c: usize, token: u32) {
        if token <= s.clients[c].floor {
            s.regression = true;
        }
        if s.instances.iter().any(|i| i.up && i.came_back_empty) {
            s.granted_after_empty = true;
        }
        s.granted_max = s.granted_max.max(token);
        s.grants += 1;
        s.clients[c].phase = Phase::Holding(token);
    }

    fn fates(&self, up: &[bool]) -> Vec<Vec<Fate>> {
        let mut all = vec![Vec::new()];
        for &u in up {
            let options: &[Fate] = if u && self.lost_replies {
                &[Fate::Lost, Fate::Answered, Fate::ReplyLost]
            } else if u {
                &[Fate::Lost, Fate::Answered]
            } else {
                &[Fate::Lost]
            };
            all = all
                .into_iter()
                .flat_map(|v| {
                    options.iter().map(move |f| {
                        let mut v = v.clone();
                        v.push(*f);
                        v
                    })
                })
                .collect();
        }
        all
    }
}

impl Model for RedlockToken {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let idle = Client {
            phase: Phase::Idle,
            epoch: 0,
            floor: 0,
            reading: None,
        };
        let inst = Instance {
            up: true,
            fence: 0,
            holder: None,
            down_since: 0,
            emptied: None,
            came_back_empty: false,
        };
        vec![State {
            now: 0,
            instances: vec![inst; self.instances],
            clients: vec![idle; self.clients],
            crashes: 0,
            granted_max: 0,
            grants: 0,
            regression: false,
            granted_after_empty: false,
        }]
    }

    fn actions(&self, s: &State, out: &mut Vec<Action>) {
        if s.now < self.max_time {
            out.push(Action::Tick);
        }
        let up: Vec<bool> = s.instances.iter().map(|i| i.up).collect();
        for (c, cl) in s.clients.iter().enumerate() {
            let c8 = c as u8;
            match cl.phase {
                Phase::Idle if cl.epoch < self.attempts[c] => {
                    for fates in self.fates(&up) {
                        out.push(Action::Acquire(c8, fates));
                    }
                }
                Phase::Raising { .. } => {
                    for mask in 0..=self.all() {
                        if (0..self.instances).all(|i| up[i] || mask & (1 << i) == 0) {
                            out.push(Action::Raise(c8, mask));
                        }
                    }
                }
                Phase::Holding(_) => out.push(Action::End(c8)),
                _ => {}
            }
        }
        for (i, inst) in s.instances.iter().enumerate() {
            let i8 = i as u8;
            if inst.up {
                if inst.holder.is_some_and(|h| !s.live(h)) {
                    out.push(Action::Expire(i8));
                }
                if s.crashes < self.crashes {
                    out.push(Action::Crash(i8));
                }
            } else if let Some(live) = &inst.emptied
                && s.now >= inst.down_since + self.down_ticks
                && !live.iter().any(|h| s.live(*h))
            {
                out.push(Action::Recover(i8));
            }
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut s = last.clone();
        match action {
            Action::Tick => s.now += 1,
            Action::Acquire(c, fates) => {
                let c = c as usize;
                let proposal = self.propose(&s, c);
                s.clients[c].floor = s.granted_max;
                s.clients[c].epoch += 1;
                let (mut granted, mut lo, mut hi) = (0u32, u32::MAX, 0);
                for (i, fate) in fates.iter().enumerate() {
                    if *fate == Fate::Lost {
                        continue;
                    }
                    let (answer, clock) = self.run_acquire(&mut s, c, i, proposal);
                    if *fate == Fate::ReplyLost {
                        continue;
                    }
                    // observe(): keep the reading that stands for the later
                    // instance time now.
                    let now = s.now;
                    let cl = &mut s.clients[c];
                    if cl
                        .reading
                        .is_none_or(|(v, at)| v + u32::from(now - at) * UNITS_PER_TICK <= clock)
                    {
                        cl.reading = Some((clock, now));
                    }
                    if let Some(a) = answer {
                        granted += 1;
                        lo = lo.min(a);
                        hi = hi.max(a);
                    }
                }
                if granted < self.majority() {
                    // Undone, or left to expire: the model leaves the keys.
                    s.clients[c].phase = Phase::Idle;
                } else if lo == hi {
                    self.grant(&mut s, c, hi);
                } else {
                    s.clients[c].phase = Phase::Raising { hi };
                }
            }
            Action::Raise(c, mask) => {
                let c = c as usize;
                let Phase::Raising { hi } = s.clients[c].phase else {
                    return None;
                };
                for i in 0..self.instances {
                    if mask & (1 << i) != 0 {
                        let inst = &mut s.instances[i];
                        inst.fence = inst.fence.max(hi);
                    }
                }
                if mask.count_ones() >= self.majority() {
                    self.grant(&mut s, c, hi);
                } else {
                    s.clients[c].phase = Phase::Idle;
                }
            }
            Action::End(c) => s.clients[c as usize].phase = Phase::Idle,
            Action::Expire(i) => s.instances[i as usize].holder = None,
            Action::Crash(i) => {
                let live: Vec<(u8, u8)> = s
                    .clients
                    .iter()
                    .enumerate()
                    .filter(|(_, cl)| cl.phase != Phase::Idle)
                    .map(|(c, cl)| (c as u8, cl.epoch))
                    .collect();
                let inst = &mut s.instances[i as usize];
                inst.up = false;
                inst.down_since = s.now;
                inst.fence = 0;
                inst.holder = None;
                inst.emptied = Some(live);
                s.crashes += 1;
            }
            Action::Recover(i) => {
                let inst = &mut s.instances[i as usize];
                inst.up = true;
                if inst.emptied.take().is_some() {
                    inst.came_back_empty = true;
                }
            }
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always("tokens of successive grants rise", |_, s: &State| {
                !s.regression
            }),
            Property::always("one valid holder at most", |_, s: &State| {
                s.clients
                    .iter()
                    .filter(|c| matches!(c.phase, Phase::Holding(_)))
                    .count()
                    <= 1
            }),
            Property::sometimes("a grant", |_, s: &State| s.grants > 0),
            Property::sometimes(
                "a grant after an instance came back empty",
                |_, s: &State| s.granted_after_empty,
            ),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_review_scenario_is_a_path() {
        use Action::*;
        use Fate::*;
        let m = RedlockToken::new(3, 1, Proposal::ClientClock);
        let mut s = m.init_states().remove(0);
        for a in [
            // The client 2 s ahead is granted on instances 0 and 1 only.
            Acquire(0, vec![Answered, Answered, Lost]),
            End(0),
            Crash(1),
            Tick,
            Recover(1),
            // The other is granted on 1 (empty) and 2, with a smaller token.
            Acquire(1, vec![Lost, Answered, Answered]),
        ] {
            let mut acts = Vec::new();
            m.actions(&s, &mut acts);
            assert!(acts.contains(&a), "{a:?} not possible in {s:#?}");
            s = m.next_state(&s, a).unwrap();
        }
        assert!(s.regression, "{s:#?}");
    }
}
