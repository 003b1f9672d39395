//! Model checks of the Redis waiting queue with handoff and grants where a
//! waiter stands (`fencelock_models::redis_queue`; bounds and state counts:
//! `docs/SAFETY.md`).

use fencelock_models::redis_queue::{Action, Lapse, RedisQueue, TaskDef, Undo, WaitGrants};
use stateright::{Checker, HasDiscoveries, Model};

/// The most states a check may generate (counting states reached again:
/// stateright's `target_state_count` counts those): a memory bound. A check
/// of a whole state space asserts that it stayed below.
const CAP: usize = 50_000_000;

/// The *always* properties (each must have no counterexample).
const ALWAYS: [&str; 4] = [
    "one writer at most, never beside readers",
    "no grant ahead of a live waiter of another process",
    "nobody waits forever",
    "a waiter that left holds nothing handed to it",
];
const HANDOFF: &str = "a handoff";
const JOINED: &str = "a head's own request joined a handed hold";
const BY_MESSAGE: &str = "a grant handed where the waiter stood was taken up by message";
const BY_ASK: &str = "a grant handed where the waiter stood was taken up by the waiter's own ask";

/// Tasks as (process, reader).
fn tasks(defs: &[(u8, bool)]) -> Vec<TaskDef> {
    defs.iter()
        .map(|&(process, reader)| TaskDef { process, reader })
        .collect()
}

/// Checks the whole state space of `model` (or, with `steps`, every
/// behaviour of at most that many steps): no *always* property fails, and
/// each of `reached` is reached.
fn check(model: RedisQueue, steps: Option<usize>, reached: &[&'static str]) {
    let start = std::time::Instant::now();
    let mut builder = model.checker().threads(2).target_state_count(CAP);
    if let Some(n) = steps {
        // stateright numbers the initial state's depth 1 and neither checks
        // nor expands states at the target depth. One thread: only then is
        // the search level by level, so that every state is first reached
        // by a shortest path (with two, one reached first by a longer path
        // than the bound allows would be left unexpanded).
        builder = builder.threads(1).target_max_depth(n + 2);
    }
    let checker = builder.spawn_bfs().join();
    report(&checker, steps, start);
    assert!(
        checker.state_count() < CAP,
        "the check stopped at {CAP} states generated, short of the space it was to cover"
    );
    for property in ALWAYS {
        if let Some(path) = checker.discovery(property) {
            panic!("{property:?} fails: {:?}", path.into_actions());
        }
    }
    for property in reached {
        assert!(
            checker.discovery(property).is_some(),
            "{property:?} is never reached"
        );
    }
}

/// Checks `model` until `property` has a counterexample; returns it.
fn find(model: RedisQueue, property: &'static str) -> Vec<Action> {
    let start = std::time::Instant::now();
    let checker = model
        .checker()
        .threads(2)
        .target_state_count(CAP)
        .finish_when(HasDiscoveries::AnyOf([property].into()))
        .spawn_bfs()
        .join();
    report(&checker, None, start);
    let path = checker
        .discovery(property)
        .unwrap_or_else(|| panic!("no counterexample to {property:?}"))
        .into_actions();
    println!("  counterexample to {property:?}: {path:?}");
    path
}

fn report(checker: &impl Checker<RedisQueue>, steps: Option<usize>, start: std::time::Instant) {
    let m = checker.model();
    let who: Vec<String> = m
        .tasks
        .iter()
        .map(|t| format!("{}{}", t.process, if t.reader { "r" } else { "w" }))
        .collect();
    println!(
        "tasks {} (process, w/r), {} requests each, {} handoff(s) in a row, {} death(s), lost replies {}, give-ups {}, {:?}, lapse {:?}, wait grants {:?}{}: {} states ({} generated), {:.1?}",
        who.join(","),
        m.max_asks,
        m.max_handoffs,
        m.deaths,
        m.lost_replies,
        m.give_ups,
        m.undo,
        m.lapse,
        m.wait_grants,
        steps.map_or(String::new(), |n| format!(", up to {n} steps")),
        checker.unique_state_count(),
        checker.state_count(),
        start.elapsed(),
    );
}

/// The default bounds (two writers in process 0, a writer and a reader in
/// process 1, one death, lost replies), every behaviour of up to 12 steps:
/// the whole space is far too large (over 10 million states within 14
/// steps). Grants where a waiter stands are taken up by message within
/// these steps, not yet by the waiter's own ask (14 steps at least).
#[test]
fn the_queue_keeps_exclusion_order_and_progress() {
    check(
        RedisQueue::new(Undo::Exact),
        Some(12),
        &[HANDOFF, JOINED, BY_MESSAGE],
    );
}

/// The protocol before grants where a waiter stands (every waiter asks when
/// the lock is let go), with the default bounds, up to 12 steps.
#[test]
fn without_grants_where_a_waiter_stands_the_queue_keeps_them_too() {
    let mut model = RedisQueue::new(Undo::Exact);
    model.wait_grants = WaitGrants::Off;
    check(model, Some(12), &[HANDOFF, JOINED]);
}

/// Grants where a waiter stands across two processes, a writer in each,
/// with a death and lost replies: the whole state space.
#[test]
fn grants_where_a_waiter_stands_with_a_death_and_lost_replies() {
    let mut model = RedisQueue::new(Undo::Exact);
    model.tasks = tasks(&[(0, false), (1, false)]);
    check(model, None, &[JOINED, BY_MESSAGE, BY_ASK]);
}

/// Grants where a waiter stands racing a handoff within process 0 (whose
/// head, taking the handoff, leaves its place): the whole state space,
/// without deaths or lost replies.
#[test]
fn grants_where_a_waiter_stands_beside_a_handoff() {
    let mut model = RedisQueue::new(Undo::Exact);
    model.tasks = tasks(&[(0, false), (0, false), (1, false)]);
    model.deaths = 0;
    model.lost_replies = false;
    check(model, None, &[HANDOFF, JOINED, BY_MESSAGE, BY_ASK]);
}

/// Three writers in three processes: a lock taken back from a waiter that
/// leaves is handed on to the next; the whole state space, without deaths
/// or lost replies.
#[test]
fn grants_where_a_waiter_stands_pass_on_to_the_next() {
    let mut model = RedisQueue::new(Undo::Exact);
    model.tasks = tasks(&[(0, false), (1, false), (2, false)]);
    model.deaths = 0;
    model.lost_replies = false;
    check(model, None, &[BY_MESSAGE, BY_ASK]);
}

/// A reader beside the writers (the lock let go by its last reader is
/// handed on; readers never overtake a waiting writer): the whole state
/// space, with a death, without lost replies.
#[test]
fn grants_where_a_waiter_stands_beside_a_reader() {
    let mut model = RedisQueue::new(Undo::Exact);
    model.tasks = tasks(&[(0, false), (1, false), (1, true)]);
    model.lost_replies = false;
    check(model, None, &[BY_MESSAGE, BY_ASK]);
}

/// The mutation check: an undo that takes back the whole hold its op found
/// lets the head's given-up request take back what a handoff gave it. (No
/// lost replies, so that the only way for two ops to claim one hold is the
/// handoff racing the head's own request.)
#[test]
fn an_undo_that_takes_the_whole_hold_gives_two_writers() {
    let mut model = RedisQueue::new(Undo::WholeHold);
    model.lost_replies = false;
    let path = find(model, "one writer at most, never beside readers");
    assert!(
        path.iter().any(|a| matches!(a, Action::RunOrphan(_))),
        "the counterexample has no given-up request joining the handed hold"
    );
}

/// The timing assumption is needed: a live waiter whose place lapses (it
/// did not ask again in time) is overtaken.
#[test]
fn a_live_waiter_whose_place_lapses_is_overtaken() {
    let mut model = RedisQueue::new(Undo::Exact);
    model.lapse = Lapse::AlsoLive;
    find(model, "no grant ahead of a live waiter of another process");
}

/// The lapse is needed: without it a dead waiter's place blocks the queue
/// for ever (the liveness property can fail).
#[test]
fn without_lapses_a_dead_waiter_blocks_the_queue() {
    let mut model = RedisQueue::new(Undo::Exact);
    model.lapse = Lapse::Never;
    find(model, "nobody waits forever");
}

/// The mutation check of grants where a waiter stands: a `LEAVE_QUEUE`
/// that marks the wait op undone but does not take back a hold handed to it
/// leaves the lock to a waiter that gave up, and the next waits for its TTL
/// (for ever, to the model).
#[test]
fn a_leave_that_keeps_the_handed_hold_blocks_the_next_waiter() {
    let mutant = || {
        let mut model = RedisQueue::new(Undo::Exact);
        model.tasks = tasks(&[(0, false), (1, false), (2, false)]);
        model.deaths = 0;
        model.lost_replies = false;
        model.wait_grants = WaitGrants::LeaveKeepsHold;
        model
    };
    let path = find(mutant(), "a waiter that left holds nothing handed to it");
    assert!(path.iter().any(|a| matches!(a, Action::RunLeave(_))));
    find(mutant(), "nobody waits forever");
}

/// The mutation check of the undone mark of a wait op: ignored, a late
/// request of a waiter that gave up stands in the queue again after its
/// `LEAVE_QUEUE`, and the lock is handed to it.
#[test]
fn a_wait_op_mark_ignored_hands_the_lock_to_a_waiter_gone() {
    let mutant = || {
        let mut model = RedisQueue::new(Undo::Exact);
        model.tasks = tasks(&[(0, false), (1, false), (2, false)]);
        model.deaths = 0;
        model.lost_replies = false;
        model.wait_grants = WaitGrants::MarkIgnored;
        model
    };
    let path = find(mutant(), "a waiter that left holds nothing handed to it");
    assert!(path.iter().any(|a| matches!(a, Action::RunOrphan(_))));
    find(mutant(), "nobody waits forever");
}

/// `hand_on`'s own check of the mark is not needed within these bounds:
/// `ACQUIRE` does not stand a late request of a waiter that gave up in the
/// queue, and `LEAVE_QUEUE` marks and leaves in one step, so no place with
/// a marked wait op is ever first. (A defence in depth, e.g. for a mark
/// that lapsed; not a mutation that must fail.)
#[test]
fn hand_on_ignoring_the_mark_breaks_nothing_here() {
    let mut model = RedisQueue::new(Undo::Exact);
    model.tasks = tasks(&[(0, false), (1, false), (2, false)]);
    model.deaths = 0;
    model.lost_replies = false;
    model.wait_grants = WaitGrants::HandOnIgnoresMark;
    check(model, None, &[BY_MESSAGE, BY_ASK]);
}
