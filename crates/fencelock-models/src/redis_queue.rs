//! The Redis waiting queue with handoff and grants where a waiter stands, on
//! one Redis.
//!
//! Abstracts the scripts `ACQUIRE` (exclusive and shared; a refused
//! exclusive request stands in the queue; a free lock goes only to the first in
//! the queue; a shared request is refused while anyone stands there), `RELEASE`
//! (with `next_owner`: the lock passes to the releaser's next local waiter in
//! the same step), `UNDO`, `LEAVE_QUEUE` and their `hand_on` of
//! `crates/fencelock-redis/src/scripts.rs`, and the clients' side: a releaser
//! hands over to a waiter of its own process (`Guard::release` with
//! `Lines::take_offer` in `crates/fencelock-core/src/line`), at most
//! [`RedisQueue::max_handoffs`] times in a row; the head's own acquire races
//! the handoff, and the one that loses is given up (an acquire dropped in
//! flight is undone, `Pending` in `crates/fencelock-redis/src/lib.rs`, and
//! its place left, `InQueue`); and grants where a waiter stands
//! ([`WaitGrants`]; `RedisBackend::acquire` with its wait op).
//!
//! # Grants where a waiter stands
//!
//! A writer refused once listens for grants: every later request of its
//! wait carries its *wait op*, and a refused one leaves that request beside
//! its place (`P{k}:qd`). When the lock is let go — a `RELEASE` without a
//! local waiter to hand to, an `UNDO` that frees the hold, a `LEAVE_QUEUE`
//! that takes back a hold handed to its wait, the last reader's release —
//! `hand_on` makes the first waiter in the queue the holder (the hold's grant
//! is its wait op) if its place keeps its request, passing over (and taking
//! out) a waiter whose wait op is marked undone, and sends it a *grant
//! message*. The message arrives at any later step, or is lost; the waiter
//! takes it up if it is still waiting (a message arriving during one of its
//! own requests is read after that request's answer), else it is ignored —
//! the wait ended, or took up the hold by its own request, which finds the
//! hold by the wait op (and which the waiter may send at any step, since it
//! would be granted). A waiter that gives up, and a head whose wait at the
//! server is dropped for a handoff of its own process, send `LEAVE_QUEUE`
//! with the wait op (in flight: it runs at any later step, also after a
//! `hand_on` to that wait): it marks the wait op undone, takes back a hold
//! whose grant is that wait op (if no other op claims it, the lock is handed
//! on, or freed), and leaves the queue. A request carrying a wait op marked
//! undone does not stand in the queue. A dead waiter's handed hold expires.
//!
//! # The model
//!
//! Tasks (each in a process) take a key once each. Every request is a
//! message: it runs at the server (atomically, like a script) at any later
//! step, and its reply comes back at any later step, or is lost (then the
//! request is undone, and the task asks again). An acquire given up by its
//! caller — a waiter that gives up, a head whose handoff came first — stays
//! in flight and may still run before or after its undo. Pub/sub
//! notifications are not modelled as such: a waiter may ask again at any
//! step at which asking would be granted (so a lost notification costs
//! time, which the model does not measure); it also asks once right away
//! when it starts listening for grants (the client's first request with its
//! wait op). Grant messages are modelled (above). A process may die: its
//! holds (also one handed to it where it stood) expire, and its waiters'
//! places lapse, at any later step; a live waiter's place never lapses (it
//! asks again within a third of it). A hold expires only when nobody keeps
//! it: no guard renews it, no reply or grant message is on the way to it,
//! and it is not handed to a waiter still waiting (which finds it by asking,
//! well within the TTL). Messages in flight are bags (kept sorted, so that
//! two orders of the same messages are one state).
//!
//! # Properties
//!
//! - *always* `one writer at most, never beside readers` (among the tasks
//!   that hold a lock they believe valid);
//! - *always* `no grant ahead of a live waiter of another process`: a fresh
//!   grant (not a handoff; a grant where a waiter stands is one) never goes
//!   to a task while a writer of another process that was refused before
//!   it still waits — in particular a releaser cannot take the lock back
//!   ahead of it, and readers cannot overtake (and so starve) a waiting
//!   writer;
//! - *always* `nobody waits forever`: when nothing more can happen, no live
//!   task is still waiting (while every holder releases, the head is
//!   granted). The expiry of a hold handed where a waiter of a live process
//!   stood does not count as something that can happen: that hold is its
//!   leaving's to take back, and one left to its TTL blocks the queue for a
//!   TTL, which the model, without time, counts as for ever;
//! - *always* `a waiter that left holds nothing handed to it`: no hold's
//!   grant is a wait op marked undone;
//! - *sometimes* `a handoff`, *sometimes* `a head's own request joined a
//!   handed hold` (the race the undo rule is about), and *sometimes* `a grant
//!   handed where the waiter stood was taken up by message` and `... by the
//!   waiter's own ask` (the model is not vacuous).
//!
//! # Left out
//!
//! TTL expiry of a live holder (holders release; only holds nobody keeps
//! expire), reentrancy, semaphores, Redis losing its data, time (lapses and
//! expiries are steps, allowed only under the timing assumptions above: a
//! grant message used only within the lease it names, a waiter asking
//! again within its place's life and within the TTL of a hold handed to
//! it), the grant message's attempt op and lease start (a message is
//! either used in time or, as the client does with one too late, not at
//! all), a waiter that listens already at its first request (a recent wait
//! on the key), a wait that ends on an error and a new wait of the same
//! acquire (a lost reply is undone and the same wait goes on), replicas
//! (`wait_replicas`, under which waiters ask without a wait op: that is
//! [`WaitGrants::Off`]), lost `LEAVE_QUEUE`s (best effort in the client: the
//! place lapses and a hold handed to it expires, which costs time only),
//! and the core's line itself (every waiter of a process may ask the server,
//! not only its line's head: more behaviours, not fewer).

use stateright::{Model, Property};

/// How `UNDO` takes an op back.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Undo {
    /// Today's rule: the op leaves its grant, and the hold goes only when no
    /// other op claims that grant.
    Exact,
    /// The bug the review found: the undo of the head's own request takes
    /// back the hold it found, also when a handoff gave that hold.
    WholeHold,
}

/// Whose places in the queue lapse.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Lapse {
    /// Today's: the places of waiters that stopped waiting (gave up without
    /// their `LEAVE_QUEUE` arriving yet, or died); a live waiter asks again in
    /// time.
    Gone,
    /// None: a place lasts for ever (a dead waiter blocks the queue).
    Never,
    /// Also a live waiter's (the timing assumption broken: it did not ask
    /// again in time).
    AlsoLive,
}

/// Grants where a waiter stands (`hand_on` in the scripts; `wait` in the
/// client's `acquire`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WaitGrants {
    /// None: the protocol before them (a freed lock is only announced; the
    /// waiters ask).
    Off,
    /// Today's: a waiter asks with its wait op once refused; a lock let go
    /// is handed to the first waiter whose place keeps its request and whose
    /// wait op is not marked undone; `LEAVE_QUEUE` marks the wait op undone
    /// and takes back a hold handed to it.
    On,
    /// A bug: `LEAVE_QUEUE` marks the wait op undone and leaves the queue,
    /// but does not take back a hold handed to that wait op.
    LeaveKeepsHold,
    /// A bug: the undone mark of a wait op is ignored (a late request of a
    /// waiter that gave up stands in the queue again with its request, and
    /// `hand_on` does not pass over it).
    MarkIgnored,
    /// Only `hand_on` ignores the mark (`ACQUIRE` still does not stand a
    /// late request of a waiter that gave up in the queue): shows whether
    /// `hand_on`'s own check is needed.
    HandOnIgnoresMark,
}

/// One task: its process, and whether it reads (shared) or writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TaskDef {
    /// The process (the `Locker`) the task runs in.
    pub process: u8,
    /// A shared request (else exclusive).
    pub reader: bool,
}

/// The model's parameters (its bounds).
#[derive(Clone, Debug)]
pub struct RedisQueue {
    /// The tasks.
    pub tasks: Vec<TaskDef>,
    /// Acquire requests a task may send in all (first one and re-checks).
    pub max_asks: u8,
    /// Handoffs in a row per process (`MAX_HANDOFFS`, 16, in the core).
    pub max_handoffs: u8,
    /// Process deaths in all.
    pub deaths: u8,
    /// Whether replies can be lost.
    pub lost_replies: bool,
    /// Whether a waiter may give up.
    pub give_ups: bool,
    /// The undo rule.
    pub undo: Undo,
    /// Whose places lapse.
    pub lapse: Lapse,
    /// Grants where a waiter stands.
    pub wait_grants: WaitGrants,
}

impl RedisQueue {
    /// Two writers in process 0 (a releaser and its local waiter), a writer
    /// and a reader in process 1; three requests per task, one handoff in a
    /// row, one death, lost replies, give-ups; places of waiters gone lapse;
    /// grants where a waiter stands.
    pub fn new(undo: Undo) -> Self {
        RedisQueue {
            tasks: vec![
                TaskDef {
                    process: 0,
                    reader: false,
                },
                TaskDef {
                    process: 0,
                    reader: false,
                },
                TaskDef {
                    process: 1,
                    reader: false,
                },
                TaskDef {
                    process: 1,
                    reader: true,
                },
            ],
            max_asks: 3,
            max_handoffs: 1,
            deaths: 1,
            lost_replies: true,
            give_ups: true,
            undo,
            lapse: Lapse::Gone,
            wait_grants: WaitGrants::On,
        }
    }

    fn op(&self, t: usize, ask: u8) -> u8 {
        (t as u8) * self.max_asks + ask
    }

    /// The id of task `t`'s release (ids above every acquire's).
    fn release_op(&self, t: usize) -> u8 {
        (self.tasks.len() as u8) * self.max_asks + t as u8
    }

    /// The id of task `t`'s wait op (ids above every release's).
    fn wait_op(&self, t: usize) -> u8 {
        (self.tasks.len() as u8) * (self.max_asks + 1) + t as u8
    }

    /// Whether task `t`'s acquire op `op` carries its wait op (sent once
    /// the task listened for grants, after its first refusal).
    fn carries_wait(&self, s: &State, t: usize, op: u8) -> bool {
        s.tasks[t]
            .waits_from
            .is_some_and(|from| op - self.op(t, 0) >= from)
    }

    /// Whether `hold` is one handed where task `task` stood: its grant is
    /// the task's wait op.
    fn handed_where_stood(&self, hold: &Hold) -> Option<usize> {
        match hold {
            Hold::Excl { task, claims } if claims.contains(&self.wait_op(*task as usize)) => {
                Some(*task as usize)
            }
            _ => None,
        }
    }

    /// `hand_on`: the lock is free; the first waiter in the queue gets it if
    /// its place keeps its request (it asked with its wait op), and is told
    /// by a message; a waiter whose wait op is marked undone is passed over
    /// (taken out of the queue). Returns whether it handed the lock on.
    fn hand_on(&self, s: &mut State) -> bool {
        if self.wait_grants == WaitGrants::Off {
            return false;
        }
        while let Some(&first) = s.queue.first() {
            let f = first as usize;
            if s.requests & (1 << f) == 0 {
                return false;
            }
            let w = self.wait_op(f);
            let checks = !matches!(
                self.wait_grants,
                WaitGrants::MarkIgnored | WaitGrants::HandOnIgnoresMark
            );
            if s.undone & (1u64 << w) == 0 || !checks {
                if self.overtakes(s, f) {
                    s.barged = true;
                }
                s.hold = Hold::Excl {
                    task: first,
                    claims: vec![w],
                };
                unqueue(s, first);
                s.arrived.retain(|&a| a != first);
                s.messages.push(first);
                return true;
            }
            unqueue(s, first);
        }
        false
    }

    /// `LEAVE_QUEUE` of task `t` (a waiter that gave up, or whose wait at
    /// the server was dropped for a handoff of its own process).
    fn run_leave(&self, s: &mut State, t: u8) {
        if self.wait_grants != WaitGrants::Off {
            let w = self.wait_op(t as usize);
            s.undone |= 1u64 << w;
            // A hold handed to the wait (not taken up) is taken back.
            if self.wait_grants != WaitGrants::LeaveKeepsHold
                && let Hold::Excl { task, claims } = &mut s.hold
                && *task == t
                && claims.contains(&w)
            {
                claims.retain(|&c| c != w);
                if claims.is_empty() {
                    s.hold = Hold::Free;
                    self.hand_on(s);
                }
            }
        }
        let first = s.queue.first() == Some(&t);
        if !s.queue.contains(&t) {
            return;
        }
        unqueue(s, t);
        if first && s.hold == Hold::Free {
            self.hand_on(s);
        }
    }

    /// Whether the hold of task `t` is kept alive: renewed by its guard, or
    /// its grant on the way to it (replies and grant messages are used only
    /// within the TTL: a grant that took longer arrives invalid,
    /// `Grant::requested_at`, and a late grant message is not used), or
    /// handed to it where it stood while it still waits (it asks again, and
    /// so finds the hold, well within the TTL).
    fn kept(&self, s: &State, t: u8) -> bool {
        let task = &s.tasks[t as usize];
        matches!(task.phase, Phase::Holding(_) | Phase::Answered(_, Some(_)))
            || s.releases
                .iter()
                .any(|r| r.next == Some(t) && r.ran == Some(true))
            || s.messages.contains(&t)
            || (task.wants() && self.handed_where_stood(&s.hold) == Some(t as usize))
    }

    /// Whether a live writer of another process was refused (and so stood
    /// in the queue) before task `t` was, and waits still.
    fn overtakes(&self, s: &State, t: usize) -> bool {
        let t8 = t as u8;
        s.arrived.iter().take_while(|&&w| w != t8).any(|&w| {
            let w = w as usize;
            self.tasks[w].process != self.tasks[t].process && s.tasks[w].wants()
        })
    }

    /// What `ACQUIRE` would answer task `t` now (without changing anything).
    fn would_grant(&self, s: &State, t: usize) -> bool {
        let t8 = t as u8;
        match (&s.hold, self.tasks[t].reader) {
            (Hold::Excl { task, .. }, false) => *task == t8,
            (Hold::Free, false) => s.queue.first().is_none_or(|&f| f == t8),
            (Hold::Free, true) | (Hold::Shared(_), true) => s.queue.is_empty(),
            _ => false,
        }
    }

    /// `ACQUIRE` of op `op` for task `t`: the grant (the op the hold is
    /// known by: `op`, or the task's wait op when the hold was handed to it
    /// where it stood), or `None` if refused.
    fn run_acquire(&self, s: &mut State, t: usize, op: u8) -> Option<u8> {
        if s.undone & (1u64 << op) != 0 {
            return None;
        }
        let t8 = t as u8;
        let reader = self.tasks[t].reader;
        let fresh = matches!(s.hold, Hold::Free) || reader;
        let wait = self.carries_wait(s, t, op);
        let w = self.wait_op(t);
        if !self.would_grant(s, t) {
            // A late request of a waiter that gave up (its wait op marked
            // undone) does not stand in the queue again.
            let stands =
                !wait || s.undone & (1u64 << w) == 0 || self.wait_grants == WaitGrants::MarkIgnored;
            if !reader && stands {
                if !s.queue.contains(&t8) {
                    s.queue.push(t8);
                }
                // The place keeps the request if it carries the wait op.
                if wait {
                    s.requests |= 1 << t;
                } else {
                    s.requests &= !(1 << t);
                }
                if !s.arrived.contains(&t8) {
                    s.arrived.push(t8);
                }
            }
            return None;
        }
        if fresh && self.overtakes(s, t) {
            s.barged = true;
        }
        s.arrived.retain(|&w| w != t8);
        match &mut s.hold {
            // Handed to this wait where it stood: that grant is the wait's.
            Hold::Excl { claims, .. } if wait && claims.contains(&w) => return Some(w),
            Hold::Excl { claims, .. } => {
                if !claims.contains(&op) {
                    claims.push(op);
                    if claims.len() > 1 {
                        s.joined = true;
                    }
                }
            }
            Hold::Free if !reader => {
                s.hold = Hold::Excl {
                    task: t8,
                    claims: vec![op],
                };
                unqueue(s, t8);
            }
            Hold::Free => s.hold = Hold::Shared(vec![(t8, vec![op])]),
            Hold::Shared(holders) => match holders.iter_mut().find(|(h, _)| *h == t8) {
                // A repeat of the reader's request claims its hold too.
                Some((_, claims)) => {
                    if !claims.contains(&op) {
                        claims.push(op);
                    }
                }
                None => holders.push((t8, vec![op])),
            },
        }
        Some(op)
    }

    /// `UNDO` of op `op`; a lock it lets go is handed on.
    fn run_undo(&self, s: &mut State, op: u8) {
        s.undone |= 1u64 << op;
        match &mut s.hold {
            Hold::Excl { claims, .. } if claims.contains(&op) => {
                claims.retain(|&c| c != op);
                if claims.is_empty() || self.undo == Undo::WholeHold {
                    s.hold = Hold::Free;
                    self.hand_on(s);
                }
            }
            Hold::Shared(holders) => {
                for (_, claims) in holders.iter_mut() {
                    if claims.contains(&op) && self.undo == Undo::WholeHold {
                        claims.clear();
                    }
                    claims.retain(|&c| c != op);
                }
                holders.retain(|(_, claims)| !claims.is_empty());
                if holders.is_empty() {
                    s.hold = Hold::Free;
                    self.hand_on(s);
                }
            }
            _ => {}
        }
    }

    /// `RELEASE` of task `t`'s lease `lease`, handing over to `next` if
    /// given (else a lock let go is handed on): whether it handed over to
    /// `next`.
    fn run_release(&self, s: &mut State, t: usize, lease: u8, next: Option<u8>) -> bool {
        let t8 = t as u8;
        let r = self.release_op(t);
        match &mut s.hold {
            Hold::Excl { task, claims } if *task == t8 && claims.contains(&lease) => {
                if let Some(n) = next.filter(|_| s.undone & (1u64 << r) == 0) {
                    s.hold = Hold::Excl {
                        task: n,
                        claims: vec![r],
                    };
                    unqueue(s, n);
                    s.arrived.retain(|&w| w != n);
                    s.handoff = true;
                    return true;
                }
                s.hold = Hold::Free;
                self.hand_on(s);
            }
            Hold::Shared(holders) => {
                holders.retain(|(h, claims)| !(*h == t8 && claims.contains(&lease)));
                if holders.is_empty() {
                    s.hold = Hold::Free;
                    self.hand_on(s);
                }
            }
            _ => {}
        }
        false
    }

    /// Task `t` stops waiting for op `op`: the request stays in flight, and
    /// its undo is sent.
    fn abandon(s: &mut State, t: usize, op: u8) {
        s.orphans.push(op_of(t, op));
        s.undos.push(op);
    }
}

fn op_of(t: usize, op: u8) -> (u8, u8) {
    (t as u8, op)
}

/// Takes task `t` out of the queue, with the request its place kept.
fn unqueue(s: &mut State, t: u8) {
    s.queue.retain(|&w| w != t);
    s.requests &= !(1 << t);
}

/// The lock at the server.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Hold {
    /// Nobody holds it.
    Free,
    /// A writer, and the ops that claim its one grant.
    Excl {
        /// The holder.
        task: u8,
        /// The ops that got this hold as their grant.
        claims: Vec<u8>,
    },
    /// Readers, each with the ops that claim its grant.
    Shared(Vec<(u8, Vec<u8>)>),
}

/// Where a task is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Phase {
    /// Not started.
    Idle,
    /// Its request (op) is on the way to the server.
    Asking(u8),
    /// Its request ran; the reply is on the way: the grant (the op its hold
    /// is known by), or `None` if refused.
    Answered(u8, Option<u8>),
    /// Refused: in the queue, asks again when that would be granted.
    Waiting,
    /// Holds the lock with the grant of this op.
    Holding(u8),
    /// Released (its release is in flight or done).
    Released,
    /// Its guard learned that its hold is gone (a renewal found it gone).
    Lost,
    /// Gave up waiting.
    GaveUp,
    /// Its process died.
    Dead,
}

/// One task's state.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Task {
    /// Where it is.
    pub phase: Phase,
    /// Requests sent so far.
    pub asks: u8,
    /// Listening for grants where it stands (after its first refusal): its
    /// requests from this one on (a count of requests) carry its wait op.
    pub waits_from: Option<u8>,
}

impl Task {
    /// Still waiting for the lock (and alive).
    fn wants(&self) -> bool {
        matches!(
            self.phase,
            Phase::Asking(_) | Phase::Answered(..) | Phase::Waiting
        )
    }
}

/// A release on its way: who, its lease, the waiter it hands over to;
/// `ran` once the script ran (`Some(handed)`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Release {
    task: u8,
    lease: u8,
    next: Option<u8>,
    ran: Option<bool>,
}

/// The whole system.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct State {
    hold: Hold,
    /// Writers in the queue, in arrival order.
    queue: Vec<u8>,
    /// The writers (a bit each) whose place keeps their request: they asked
    /// with their wait op (`P{k}:qd`).
    requests: u8,
    /// Writers refused and not granted since, in the order they were first
    /// refused (the order the queue owes them; only for the properties).
    arrived: Vec<u8>,
    /// Ops marked undone (`x`).
    undone: u64,
    tasks: Vec<Task>,
    /// Handoffs in a row, per process.
    in_a_row: Vec<u8>,
    /// Requests whose caller stopped waiting for them, still in flight.
    orphans: Vec<(u8, u8)>,
    /// Undos in flight.
    undos: Vec<u8>,
    /// Releases in flight.
    releases: Vec<Release>,
    /// `LEAVE_QUEUE`s in flight.
    leaves: Vec<u8>,
    /// Grant messages in flight (`hand_on`'s publish), to these tasks.
    messages: Vec<u8>,
    deaths: u8,
    /// A handoff happened.
    handoff: bool,
    barged: bool,
    joined: bool,
    /// A grant handed where the waiter stood was taken up by its message.
    by_message: bool,
    /// ... by the waiter's own request, which found it by its wait op.
    by_ask: bool,
}

/// One step.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// Task sends an acquire request.
    Ask(u8),
    /// Task's request runs at the server.
    Run(u8),
    /// A request whose caller gave it up runs at the server.
    RunOrphan(usize),
    /// Task's reply arrives (`false`: it is lost).
    Reply(u8, bool),
    /// Holder releases (handing over where it may).
    Release(u8),
    /// A release runs at the server.
    RunRelease(usize),
    /// A release's reply arrives (`false`: lost, and a handoff is not retried).
    ReleaseReply(usize, bool),
    /// An undo runs.
    RunUndo(usize),
    /// A waiter gives up.
    GiveUp(u8),
    /// A `LEAVE_QUEUE` runs.
    RunLeave(usize),
    /// A holder's renewal finds its hold gone.
    NoticeLost(u8),
    /// A process dies.
    Die(u8),
    /// A hold nobody renews expires.
    Expire,
    /// The place of a waiter that is no longer waiting lapses.
    Lapse(u8),
    /// A grant message arrives (`false`: it is lost).
    Deliver(usize, bool),
}

impl RedisQueue {
    /// One step (before the bags in flight are sorted).
    fn step(&self, last: &State, action: Action) -> Option<State> {
        let mut s = last.clone();
        match action {
            Action::Ask(t) => {
                let task = &mut s.tasks[t as usize];
                let op = self.op(t as usize, task.asks);
                task.asks += 1;
                task.phase = Phase::Asking(op);
            }
            Action::Run(t) => {
                let Phase::Asking(op) = s.tasks[t as usize].phase else {
                    return None;
                };
                let grant = self.run_acquire(&mut s, t as usize, op);
                s.tasks[t as usize].phase = Phase::Answered(op, grant);
            }
            Action::RunOrphan(i) => {
                let (t, op) = s.orphans.remove(i);
                self.run_acquire(&mut s, t as usize, op);
            }
            Action::Reply(t, arrived) => {
                let t = t as usize;
                let Phase::Answered(op, grant) = s.tasks[t].phase else {
                    return None;
                };
                s.tasks[t].phase = if !arrived {
                    // An error: the attempt is undone, the task waits on.
                    s.undos.push(op);
                    Phase::Waiting
                } else if let Some(lease) = grant {
                    if lease == self.wait_op(t) {
                        s.by_ask = true;
                    }
                    Phase::Holding(lease)
                } else if self.tasks[t].reader && s.tasks[t].asks >= self.max_asks {
                    Phase::GaveUp
                } else {
                    // Refused: a writer listens for grants where it stands
                    // from now on, and asks with its wait op.
                    if !self.tasks[t].reader
                        && self.wait_grants != WaitGrants::Off
                        && s.tasks[t].waits_from.is_none()
                    {
                        s.tasks[t].waits_from = Some(s.tasks[t].asks);
                    }
                    Phase::Waiting
                };
            }
            Action::Release(t) => {
                let t = t as usize;
                let Phase::Holding(lease) = s.tasks[t].phase else {
                    return None;
                };
                let p = self.tasks[t].process as usize;
                // `take_offer`: the first waiter of this process, unless the
                // streak is at its bound.
                let next = if self.tasks[t].reader || s.in_a_row[p] >= self.max_handoffs {
                    None
                } else {
                    (0..self.tasks.len()).find(|&w| {
                        w != t
                            && self.tasks[w].process == self.tasks[t].process
                            && !self.tasks[w].reader
                            && s.tasks[w].wants()
                    })
                };
                s.in_a_row[p] = if next.is_some() { s.in_a_row[p] + 1 } else { 0 };
                s.releases.push(Release {
                    task: t as u8,
                    lease,
                    next: next.map(|n| n as u8),
                    ran: None,
                });
                s.tasks[t].phase = Phase::Released;
            }
            Action::RunRelease(i) => {
                let r = s.releases[i].clone();
                let handed = self.run_release(&mut s, r.task as usize, r.lease, r.next);
                s.releases[i].ran = Some(handed);
            }
            Action::ReleaseReply(i, arrived) => {
                let r = s.releases.remove(i);
                let (Some(true), Some(n), true) = (r.ran, r.next, arrived) else {
                    // Nothing handed, or the reply is lost: the waiter's own
                    // requests find a hold handed meanwhile.
                    return Some(s);
                };
                let n = n as usize;
                let handoff = self.release_op(r.task as usize);
                if s.tasks[r.task as usize].phase == Phase::Dead {
                    return Some(s);
                }
                // The head's wait at the server is dropped: its place is
                // left (with grants where it stands, its wait op is marked
                // undone and a hold handed to it is taken back).
                if s.tasks[n].wants() && self.wait_grants != WaitGrants::Off {
                    s.leaves.push(n as u8);
                }
                match s.tasks[n].phase {
                    // The head takes the handoff; its own request is given up.
                    Phase::Asking(op) | Phase::Answered(op, _) => {
                        if let Phase::Answered(_, Some(_)) = s.tasks[n].phase {
                            // Its own request already joined the handed hold:
                            // the same hold, counted once.
                        } else {
                            Self::abandon(&mut s, n, op);
                        }
                        s.tasks[n].phase = Phase::Holding(handoff);
                    }
                    Phase::Waiting => s.tasks[n].phase = Phase::Holding(handoff),
                    // Got it by its own request meanwhile (the same hold).
                    Phase::Holding(_) => {}
                    // Gone: the handed hold is given back.
                    _ => s.undos.push(handoff),
                }
            }
            Action::RunUndo(i) => {
                let op = s.undos.remove(i);
                self.run_undo(&mut s, op);
            }
            Action::GiveUp(t) => {
                let t = t as usize;
                match s.tasks[t].phase {
                    Phase::Asking(op) | Phase::Answered(op, _) => Self::abandon(&mut s, t, op),
                    _ => {}
                }
                s.tasks[t].phase = Phase::GaveUp;
                if !self.tasks[t].reader {
                    s.leaves.push(t as u8);
                }
            }
            Action::RunLeave(i) => {
                let t = s.leaves.remove(i);
                self.run_leave(&mut s, t);
            }
            Action::NoticeLost(t) => s.tasks[t as usize].phase = Phase::Lost,
            Action::Die(p) => {
                for t in 0..self.tasks.len() {
                    if self.tasks[t].process == p {
                        if let Phase::Asking(op) = s.tasks[t].phase {
                            s.orphans.push(op_of(t, op));
                        }
                        s.tasks[t].phase = Phase::Dead;
                    }
                }
                s.deaths += 1;
            }
            Action::Expire => {
                let hold = std::mem::replace(&mut s.hold, Hold::Free);
                s.hold = match hold {
                    Hold::Shared(h) => {
                        let left: Vec<(u8, Vec<u8>)> =
                            h.into_iter().filter(|(t, _)| self.kept(&s, *t)).collect();
                        if left.is_empty() {
                            Hold::Free
                        } else {
                            Hold::Shared(left)
                        }
                    }
                    _ => Hold::Free,
                };
            }
            Action::Lapse(t) => unqueue(&mut s, t),
            Action::Deliver(i, arrived) => {
                let t = s.messages.remove(i) as usize;
                // Used only by the wait it was handed to, still waiting;
                // otherwise ignored (the wait ended, or took up the hold
                // by its own request).
                if arrived && s.tasks[t].phase == Phase::Waiting {
                    s.tasks[t].phase = Phase::Holding(self.wait_op(t));
                    s.by_message = true;
                }
            }
        }
        Some(s)
    }
}

impl Model for RedisQueue {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        // Tasks are bits of a `u8`, ops bits of a `u64`.
        assert!(self.tasks.len() <= 8 && usize::from(self.wait_op(self.tasks.len())) <= 64);
        let processes = self.tasks.iter().map(|t| t.process).max().unwrap_or(0) as usize + 1;
        vec![State {
            hold: Hold::Free,
            queue: Vec::new(),
            requests: 0,
            arrived: Vec::new(),
            undone: 0,
            tasks: vec![
                Task {
                    phase: Phase::Idle,
                    asks: 0,
                    waits_from: None,
                };
                self.tasks.len()
            ],
            in_a_row: vec![0; processes],
            orphans: Vec::new(),
            undos: Vec::new(),
            releases: Vec::new(),
            leaves: Vec::new(),
            messages: Vec::new(),
            deaths: 0,
            handoff: false,
            barged: false,
            joined: false,
            by_message: false,
            by_ask: false,
        }]
    }

    fn actions(&self, s: &State, out: &mut Vec<Action>) {
        for (t, task) in s.tasks.iter().enumerate() {
            let t8 = t as u8;
            match task.phase {
                Phase::Idle => out.push(Action::Ask(t8)),
                // Asks when that would be granted (told by pub/sub), and
                // once right away when it starts listening for grants.
                Phase::Waiting
                    if task.asks < self.max_asks
                        && (self.would_grant(s, t) || task.waits_from == Some(task.asks)) =>
                {
                    out.push(Action::Ask(t8))
                }
                Phase::Asking(_) => out.push(Action::Run(t8)),
                Phase::Answered(..) => {
                    out.push(Action::Reply(t8, true));
                    if self.lost_replies {
                        out.push(Action::Reply(t8, false));
                    }
                }
                Phase::Holding(lease) => {
                    out.push(Action::Release(t8));
                    if !self.holds(s, t, lease) {
                        out.push(Action::NoticeLost(t8));
                    }
                }
                _ => {}
            }
            if self.give_ups && task.wants() {
                out.push(Action::GiveUp(t8));
            }
            // A waiter out of requests gives up (its deadline).
            if task.phase == Phase::Waiting && task.asks >= self.max_asks && !self.give_ups {
                out.push(Action::GiveUp(t8));
            }
            let lapses = match self.lapse {
                Lapse::Gone => !task.wants(),
                Lapse::Never => false,
                Lapse::AlsoLive => true,
            };
            if lapses && s.queue.contains(&t8) {
                out.push(Action::Lapse(t8));
            }
        }
        for i in 0..s.orphans.len() {
            out.push(Action::RunOrphan(i));
        }
        for (i, r) in s.releases.iter().enumerate() {
            match r.ran {
                None => out.push(Action::RunRelease(i)),
                Some(_) => {
                    out.push(Action::ReleaseReply(i, true));
                    if self.lost_replies {
                        out.push(Action::ReleaseReply(i, false));
                    }
                }
            }
        }
        for i in 0..s.undos.len() {
            out.push(Action::RunUndo(i));
        }
        for i in 0..s.leaves.len() {
            out.push(Action::RunLeave(i));
        }
        for (i, &t) in s.messages.iter().enumerate() {
            // A message that arrives during the task's own request waits
            // until that request's answer (the client reads it then).
            if !matches!(
                s.tasks[t as usize].phase,
                Phase::Asking(_) | Phase::Answered(..)
            ) {
                out.push(Action::Deliver(i, true));
            }
            out.push(Action::Deliver(i, false));
        }
        if s.deaths < self.deaths {
            let mut seen = Vec::new();
            for (t, task) in s.tasks.iter().enumerate() {
                let p = self.tasks[t].process;
                if task.phase != Phase::Dead && !seen.contains(&p) {
                    seen.push(p);
                    out.push(Action::Die(p));
                }
            }
        }
        match &s.hold {
            Hold::Excl { task, .. } if !self.kept(s, *task) => out.push(Action::Expire),
            Hold::Shared(h) if h.iter().any(|(t, _)| !self.kept(s, *t)) => out.push(Action::Expire),
            _ => {}
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut s = self.step(last, action)?;
        // Messages in flight are bags (any of them may arrive next): kept
        // sorted, so that two orders of the same bag are one state.
        s.orphans.sort_unstable();
        s.undos.sort_unstable();
        s.releases.sort_unstable();
        s.leaves.sort_unstable();
        s.messages.sort_unstable();
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        let mut properties = vec![
            Property::always(
                "one writer at most, never beside readers",
                |m: &RedisQueue, s: &State| {
                    let holding = |reader: bool| {
                        s.tasks
                            .iter()
                            .enumerate()
                            .filter(|(t, task)| {
                                m.tasks[*t].reader == reader
                                    && matches!(task.phase, Phase::Holding(_))
                            })
                            .count()
                    };
                    let writers = holding(false);
                    writers <= 1 && (writers == 0 || holding(true) == 0)
                },
            ),
            Property::always(
                "no grant ahead of a live waiter of another process",
                |_, s: &State| !s.barged,
            ),
            Property::always("nobody waits forever", |m: &RedisQueue, s: &State| {
                // Stuck: someone waits, and nothing but a fault (a death, a
                // waiter giving up before its budget is spent) can happen —
                // or the expiry of a hold handed where a live waiter stood
                // (its process lives, so its leaving takes that hold back: a
                // hold left to its TTL blocks the queue for a TTL, which
                // the model counts as for ever).
                let mut next = Vec::new();
                m.actions(s, &mut next);
                let progress = next.iter().any(|a| match a {
                    Action::Die(_) => false,
                    Action::GiveUp(t) => s.tasks[*t as usize].asks >= m.max_asks,
                    Action::Expire => m
                        .handed_where_stood(&s.hold)
                        .is_none_or(|t| s.tasks[t].phase == Phase::Dead),
                    _ => true,
                });
                progress || !s.tasks.iter().any(Task::wants)
            }),
            Property::always(
                "a waiter that left holds nothing handed to it",
                |m: &RedisQueue, s: &State| {
                    m.handed_where_stood(&s.hold)
                        .is_none_or(|t| s.undone & (1u64 << m.wait_op(t)) == 0)
                },
            ),
            Property::sometimes("a handoff", |_, s: &State| s.handoff),
            Property::sometimes(
                "a head's own request joined a handed hold",
                |_, s: &State| s.joined,
            ),
        ];
        if self.wait_grants != WaitGrants::Off {
            properties.push(Property::sometimes(
                "a grant handed where the waiter stood was taken up by message",
                |_, s: &State| s.by_message,
            ));
            properties.push(Property::sometimes(
                "a grant handed where the waiter stood was taken up by the waiter's own ask",
                |_, s: &State| s.by_ask,
            ));
        }
        properties
    }
}

impl RedisQueue {
    /// Whether the server still holds task `t`'s grant `lease`.
    fn holds(&self, s: &State, t: usize, lease: u8) -> bool {
        let t8 = t as u8;
        match &s.hold {
            Hold::Excl { task, claims } => *task == t8 && claims.contains(&lease),
            Hold::Shared(h) => h.iter().any(|(t, c)| *t == t8 && c.contains(&lease)),
            Hold::Free => false,
        }
    }
}
