//! One renewal call with two leases of the same owner on the same key (an
//! outer hold and a reentrant one with a shorter TTL, renewed in one batch by
//! the watchdog): the row must be extended by the longer TTL. (Found by the
//! torture campaign: PostgreSQL's `UPDATE … FROM` with two matching rows uses
//! one of them, unpredictably; with the nested hold's TTL, the server let the
//! outer hold expire while its guard still believed it valid.)

mod support;

use std::time::Duration;

use fencelock_core::backend::{LeaseRef, Renewal, Request};
use fencelock_core::{Backend, Key, Mode, Owner};
use fencelock_postgres::PostgresBackend;
use support::SHARED;

async fn expires_in(b: &PostgresBackend, key: &Key) -> Duration {
    let info = b.inspect(key).await.unwrap().expect("held");
    info.holders[0].expires_in.expect("an expiry")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_with_a_shorter_reentrant_lease_extends_by_the_longer_ttl() {
    let b = PostgresBackend::connect(&format!("{SHARED}?mode=lease"))
        .await
        .unwrap();
    for (round, outer_first) in [true, false].into_iter().enumerate() {
        let key = Key::new(format!("renewal-{}-{round}", std::process::id())).unwrap();
        let owner = Owner::new("outer-and-nested").unwrap();
        let req = |ttl| Request::new(key.clone(), owner.clone(), Mode::Exclusive, ttl);
        let outer_req = req(Duration::from_secs(8));
        let outer = b.try_acquire(&outer_req).await.unwrap().unwrap();
        tokio::time::sleep(Duration::from_secs(4)).await;
        let nested_req = req(Duration::from_secs(1));
        let nested = b.try_acquire(&nested_req).await.unwrap().unwrap();
        let (o, n) = (
            LeaseRef::new(&outer_req, &outer),
            LeaseRef::new(&nested_req, &nested),
        );
        let batch = if outer_first { vec![o, n] } else { vec![n, o] };
        let renewed = b.renew(&batch).await.unwrap();
        assert!(
            renewed.iter().all(|r| matches!(r, Renewal::Held { .. })),
            "{renewed:?}"
        );
        // The outer lease was renewed for 8 s: its guard now trusts it ~8 s.
        let left = expires_in(&b, &key).await;
        assert!(
            left > Duration::from_secs(6),
            "renewed with the outer lease's 8 s, the row expires in {left:?} (outer first: {outer_first})"
        );
        b.force_release(&key).await.unwrap();
    }
}
