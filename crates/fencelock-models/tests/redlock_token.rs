//! Model checks of the Redlock fencing token (`fencelock_models::redlock_token`;
//! bounds and state counts: `docs/SAFETY.md`).

use fencelock_models::redlock_token::{Proposal, RedlockToken};
use stateright::{Checker, Model};

fn check(model: RedlockToken) -> impl Checker<RedlockToken> {
    let checker = model.checker().threads(2).spawn_bfs().join();
    let m = checker.model();
    println!(
        "{} instances, {} crash, acquires {:?}, {} ticks, lost replies {}, {:?}: {} states",
        m.instances,
        m.crashes,
        m.attempts,
        m.max_time,
        m.lost_replies,
        m.proposal,
        checker.unique_state_count()
    );
    checker
}

/// 5 instances: one acquire per client, one tick, no lost replies (so that
/// the check stays within a minute and a couple of GB).
fn five(proposal: Proposal) -> RedlockToken {
    let mut m = RedlockToken::new(5, 1, proposal);
    m.attempts = vec![1, 1];
    m.max_time = 1;
    m.lost_replies = false;
    m
}

#[test]
fn tokens_rise_and_one_holder_on_3_instances() {
    check(RedlockToken::new(3, 1, Proposal::InstanceClocks)).assert_properties();
}

#[test]
fn tokens_rise_and_one_holder_on_5_instances() {
    check(five(Proposal::InstanceClocks)).assert_properties();
}

/// The mutation check: the proposal the review found (the client's clock
/// plus a second) lets a token go back — the model must find it.
#[test]
fn a_proposal_from_the_client_clock_lets_a_token_go_back() {
    for model in [
        RedlockToken::new(3, 1, Proposal::ClientClock),
        five(Proposal::ClientClock),
    ] {
        let checker = check(model);
        let path = checker
            .discovery("tokens of successive grants rise")
            .expect("the checker finds the regression the review found");
        println!("counterexample: {:?}", path.into_actions());
        assert!(
            checker.discovery("one valid holder at most").is_none(),
            "the proposal rule does not touch exclusion"
        );
    }
}

/// The assumption is needed: an instance that lost its data and comes back
/// at once (sooner than the instances' clock difference plus the margin) lets
/// a token go back even with today's proposal.
#[test]
fn an_emptied_instance_back_at_once_lets_a_token_go_back() {
    let mut model = RedlockToken::new(3, 1, Proposal::InstanceClocks);
    model.down_ticks = 0;
    model.attempts = vec![1, 1];
    let checker = check(model);
    assert!(
        checker
            .discovery("tokens of successive grants rise")
            .is_some(),
        "the clock floor needs the emptied instance to stay down"
    );
}
