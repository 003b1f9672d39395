//! Model checks of the Redis waiting queue with handoff
//! (`fencelock_models::redis_queue`; bounds and state counts: `docs/SAFETY.md`).

use fencelock_models::redis_queue::{Lapse, RedisQueue, Undo};
use stateright::{Checker, HasDiscoveries, Model};

/// The largest state count a check may reach (memory: the mutations' state
/// spaces are much larger than today's; their checks stop at the first
/// counterexample, found within a few thousand states).
const CAP: usize = 5_000_000;

fn check(model: RedisQueue) -> impl Checker<RedisQueue> {
    let checker = model
        .checker()
        .threads(2)
        .target_state_count(CAP)
        .spawn_bfs()
        .join();
    assert!(
        checker.unique_state_count() < CAP,
        "the check stopped at {CAP} states, short of the whole space"
    );
    report(checker)
}

/// Checks `model` until `property` has a discovery.
fn find(model: RedisQueue, property: &'static str) -> impl Checker<RedisQueue> {
    let checker = model
        .checker()
        .threads(2)
        .target_state_count(CAP)
        .finish_when(HasDiscoveries::AnyOf([property].into()))
        .spawn_bfs()
        .join();
    report(checker)
}

fn report(checker: impl Checker<RedisQueue>) -> impl Checker<RedisQueue> {
    let m = checker.model();
    println!(
        "{} tasks, {} requests each, {} handoff(s) in a row, {} death(s), lost replies {}, give-ups {}, {:?}, lapse {:?}: {} states",
        m.tasks.len(),
        m.max_asks,
        m.max_handoffs,
        m.deaths,
        m.lost_replies,
        m.give_ups,
        m.undo,
        m.lapse,
        checker.unique_state_count()
    );
    checker
}

#[test]
fn the_queue_keeps_exclusion_order_and_progress() {
    check(RedisQueue::new(Undo::Exact)).assert_properties();
}

/// The mutation check: an undo that takes back the whole hold its op found
/// lets the head's given-up request take back what a handoff gave it. (No
/// lost replies, so that the only way for two ops to claim one hold is the
/// handoff racing the head's own request.)
#[test]
fn an_undo_that_takes_the_whole_hold_gives_two_writers() {
    let mut model = RedisQueue::new(Undo::WholeHold);
    model.lost_replies = false;
    let checker = find(model, "one writer at most, never beside readers");
    let path = checker
        .discovery("one writer at most, never beside readers")
        .expect("the checker finds the handoff the head's undo took back")
        .into_actions();
    println!("counterexample: {path:?}");
    assert!(
        path.iter()
            .any(|a| matches!(a, fencelock_models::redis_queue::Action::RunOrphan(_))),
        "the counterexample has no given-up request joining the handed hold"
    );
}

/// The timing assumption is needed: a live waiter whose place lapses (it
/// did not ask again in time) is overtaken.
#[test]
fn a_live_waiter_whose_place_lapses_is_overtaken() {
    let mut model = RedisQueue::new(Undo::Exact);
    model.lapse = Lapse::AlsoLive;
    let checker = find(model, "no grant ahead of a live waiter of another process");
    assert!(
        checker
            .discovery("no grant ahead of a live waiter of another process")
            .is_some(),
        "a lapsed place lets a later request in first"
    );
}

/// The lapse is needed: without it a dead waiter's place blocks the queue
/// for ever (the liveness property can fail).
#[test]
fn without_lapses_a_dead_waiter_blocks_the_queue() {
    let mut model = RedisQueue::new(Undo::Exact);
    model.lapse = Lapse::Never;
    let checker = find(model, "nobody waits forever");
    assert!(
        checker.discovery("nobody waits forever").is_some(),
        "a place that never lapses should leave someone waiting"
    );
}
