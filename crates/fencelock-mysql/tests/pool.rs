//! A pool whose every connection stays busy: the error says so and names
//! the option that raises it, rather than only "cannot reach".

mod support;

use std::time::Duration;

use fencelock_core::Locker;
use fencelock_mysql::MySqlBackend;
use support::SHARED;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_pool_is_named_as_the_cause() {
    let backend = MySqlBackend::connect(&format!("{SHARED}?pool=1"))
        .await
        .unwrap();
    // The pool's only connection, kept busy by someone else's work.
    let busy = backend.pool().acquire().await.unwrap();
    let locker = Locker::new(backend.clone());
    let r = locker
        .lock("pool-busy")
        .wait(Duration::from_secs(12))
        .acquire()
        .await;
    drop(busy);
    let e = match r {
        Ok(g) => panic!("granted with no free connection: {:?}", g.token()),
        Err(e) => e.to_string(),
    };
    assert!(
        e.contains("raise `pool=`"),
        "the error does not name the busy pool as a cause: {e}"
    );
}
