//! The Redis waiting queue with handoff, on one Redis.
//!
//! Abstracts the scripts `ACQUIRE` (exclusive and shared; a refused
//! exclusive request stands in the queue; a free lock goes only to the first in
//! the queue; a shared request is refused while anyone stands there), `RELEASE`
//! (with `next_owner`: the lock passes to the releaser's next local waiter in
//! the same step), `UNDO` and `LEAVE_QUEUE` of
//! `crates/fencelock-redis/src/scripts.rs`, and the core's side: a releaser
//! hands over to a waiter of its own process (`Guard::release` with
//! `Lines::take_offer` in `crates/fencelock-core/src/line`), at most
//! [`RedisQueue::max_handoffs`] times in a row; the head's own acquire races
//! the handoff, and the one that loses is given up (an acquire dropped in
//! flight is undone, `Pending` in `crates/fencelock-redis/src/lib.rs`).
//!
//! # The model
//!
//! Tasks (each in a process) take a key once each. Every request is a
//! message: it runs at the server (atomically, like a script) at any later
//! step, and its reply comes back at any later step, or is lost (then the
//! request is undone, and the task asks again). An acquire given up by its
//! caller — a waiter that gives up, a head whose handoff came first — stays
//! in flight and may still run before or after its undo. Pub/sub is not
//! modelled as such: a waiter may ask again at any step at which asking would
//! be granted (so a lost notification costs time, which the model does not
//! measure). A process may die: its holds expire, and its waiters' places
//! lapse, at any later step; a live waiter's place never lapses (it asks
//! again within a third of it).
//!
//! # Properties
//!
//! - *always* `one writer at most, never beside readers` (among the tasks
//!   that hold a lock they believe valid);
//! - *always* `no grant ahead of a live waiter of another process`: a fresh
//!   grant (not a handoff) never goes to a task while a writer of another
//!   process that was refused before it still waits — in particular a
//!   releaser cannot take the lock back ahead of it, and readers cannot
//!   overtake (and so starve) a waiting writer;
//! - *always* `nobody waits forever`: when nothing more can happen, no live
//!   task is still waiting (while every holder releases, the head is granted);
//! - *sometimes* `a handoff`, and *sometimes* `a head's own request joined a
//!   handed hold` (the race the undo rule is about; the model is not vacuous).
//!
//! # Left out
//!
//! TTL expiry of a live holder (holders release; only dead ones' holds
//! expire), reentrancy, semaphores, Redis losing its data, time (lapses and
//! expiries are steps, allowed only under the timing assumption above).

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
}

impl RedisQueue {
    /// Two writers in process 0 (a releaser and its local waiter), a writer
    /// and a reader in process 1; three requests per task, one handoff in a
    /// row, one death, lost replies, give-ups; places of waiters gone lapse.
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
        }
    }

    fn op(&self, t: usize, ask: u8) -> u8 {
        (t as u8) * self.max_asks + ask
    }

    /// The id of task `t`'s release (ids above every acquire's).
    fn release_op(&self, t: usize) -> u8 {
        (self.tasks.len() as u8) * self.max_asks + t as u8
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

    /// `ACQUIRE` of op `op` for task `t`: whether granted.
    fn run_acquire(&self, s: &mut State, t: usize, op: u8) -> bool {
        if s.undone & (1u64 << op) != 0 {
            return false;
        }
        let t8 = t as u8;
        let reader = self.tasks[t].reader;
        let fresh = matches!(s.hold, Hold::Free) || reader;
        if !self.would_grant(s, t) {
            if !reader && !s.queue.contains(&t8) {
                s.queue.push(t8);
            }
            if !reader && !s.arrived.contains(&t8) {
                s.arrived.push(t8);
            }
            return false;
        }
        if fresh && self.overtakes(s, t) {
            s.barged = true;
        }
        s.arrived.retain(|&w| w != t8);
        match &mut s.hold {
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
                s.queue.retain(|&w| w != t8);
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
        true
    }

    /// `UNDO` of op `op`.
    fn run_undo(&self, s: &mut State, op: u8) {
        s.undone |= 1u64 << op;
        match &mut s.hold {
            Hold::Excl { claims, .. } if claims.contains(&op) => {
                claims.retain(|&c| c != op);
                if claims.is_empty() || self.undo == Undo::WholeHold {
                    s.hold = Hold::Free;
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
                }
            }
            _ => {}
        }
    }

    /// `RELEASE` of task `t`'s lease `lease`, handing over to `next` if
    /// given: whether it handed over.
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
                    s.queue.retain(|&w| w != n);
                    s.arrived.retain(|&w| w != n);
                    s.handoffs += 1;
                    return true;
                }
                s.hold = Hold::Free;
            }
            Hold::Shared(holders) => {
                holders.retain(|(h, claims)| !(*h == t8 && claims.contains(&lease)));
                if holders.is_empty() {
                    s.hold = Hold::Free;
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
    /// Its request ran; the reply (granted or not) is on the way.
    Answered(u8, bool),
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
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
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
    deaths: u8,
    handoffs: u8,
    barged: bool,
    joined: bool,
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
}

impl Model for RedisQueue {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let processes = self.tasks.iter().map(|t| t.process).max().unwrap_or(0) as usize + 1;
        vec![State {
            hold: Hold::Free,
            queue: Vec::new(),
            arrived: Vec::new(),
            undone: 0,
            tasks: vec![
                Task {
                    phase: Phase::Idle,
                    asks: 0
                };
                self.tasks.len()
            ],
            in_a_row: vec![0; processes],
            orphans: Vec::new(),
            undos: Vec::new(),
            releases: Vec::new(),
            leaves: Vec::new(),
            deaths: 0,
            handoffs: 0,
            barged: false,
            joined: false,
        }]
    }

    fn actions(&self, s: &State, out: &mut Vec<Action>) {
        for (t, task) in s.tasks.iter().enumerate() {
            let t8 = t as u8;
            match task.phase {
                Phase::Idle => out.push(Action::Ask(t8)),
                Phase::Waiting if task.asks < self.max_asks && self.would_grant(s, t) => {
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
            Hold::Excl { task, .. } if !s.kept(*task) => out.push(Action::Expire),
            Hold::Shared(h) if h.iter().any(|(t, _)| !s.kept(*t)) => out.push(Action::Expire),
            _ => {}
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
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
                let granted = self.run_acquire(&mut s, t as usize, op);
                s.tasks[t as usize].phase = Phase::Answered(op, granted);
            }
            Action::RunOrphan(i) => {
                let (t, op) = s.orphans.remove(i);
                self.run_acquire(&mut s, t as usize, op);
            }
            Action::Reply(t, arrived) => {
                let t = t as usize;
                let Phase::Answered(op, granted) = s.tasks[t].phase else {
                    return None;
                };
                s.tasks[t].phase = if !arrived {
                    // An error: the attempt is undone, the task waits on.
                    s.undos.push(op);
                    Phase::Waiting
                } else if granted {
                    Phase::Holding(op)
                } else if self.tasks[t].reader && s.tasks[t].asks >= self.max_asks {
                    Phase::GaveUp
                } else {
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
                match s.tasks[n].phase {
                    // The head takes the handoff; its own request is given up.
                    Phase::Asking(op) | Phase::Answered(op, _) => {
                        if let Phase::Answered(_, true) = s.tasks[n].phase {
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
                s.queue.retain(|&w| w != t);
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
                            h.into_iter().filter(|(t, _)| s.kept(*t)).collect();
                        if left.is_empty() {
                            Hold::Free
                        } else {
                            Hold::Shared(left)
                        }
                    }
                    _ => Hold::Free,
                };
            }
            Action::Lapse(t) => s.queue.retain(|&w| w != t),
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
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
                // waiter giving up before its budget is spent) can happen.
                let mut next = Vec::new();
                m.actions(s, &mut next);
                let progress = next.iter().any(|a| match a {
                    Action::Die(_) => false,
                    Action::GiveUp(t) => s.tasks[*t as usize].asks >= m.max_asks,
                    _ => true,
                });
                progress || !s.tasks.iter().any(Task::wants)
            }),
            Property::sometimes("a handoff", |_, s: &State| s.handoffs > 0),
            Property::sometimes(
                "a head's own request joined a handed hold",
                |_, s: &State| s.joined,
            ),
        ]
    }
}

impl State {
    /// Whether a hold of task `t` is kept alive: renewed by its guard, or
    /// its grant on the way to it (replies arrive within the TTL: a grant
    /// that took longer arrives invalid, `Grant::requested_at`).
    fn kept(&self, t: u8) -> bool {
        matches!(
            self.tasks[t as usize].phase,
            Phase::Holding(_) | Phase::Answered(_, true)
        ) || self
            .releases
            .iter()
            .any(|r| r.next == Some(t) && r.ran == Some(true))
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
