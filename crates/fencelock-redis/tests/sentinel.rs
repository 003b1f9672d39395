//! `redis+sentinel://` on the shared Sentinel service (scripts/services.sh:
//! Sentinels on 7211–7213 watching `fencelock`).

use fencelock_core::Error;
use fencelock_redis::RedisBackend;

const SENTINELS: &str = "127.0.0.1:7211,127.0.0.1:7212,127.0.0.1:7213";

#[tokio::test]
async fn a_service_the_sentinels_do_not_monitor_is_a_configuration_error() {
    let e = RedisBackend::connect(&format!("redis+sentinel://{SENTINELS}/no-such-service"))
        .await
        .expect_err("no such service");
    assert!(
        matches!(e, Error::InvalidConfig { .. }) && e.to_string().contains("no-such-service"),
        "{e:?}"
    );
}

#[tokio::test]
async fn the_master_is_found_through_any_sentinel_that_answers() {
    // The first Sentinel named does not run: the next one answers.
    let b = RedisBackend::connect(&format!(
        "redis+sentinel://127.0.0.1:1,{SENTINELS}/fencelock"
    ))
    .await
    .expect("connect through the second Sentinel");
    let key = fencelock_core::Key::new("sentinel/any").unwrap();
    let g = fencelock_core::Locker::new(b)
        .lock(key.as_str())
        .acquire()
        .await
        .unwrap();
    assert!(g.token().is_some());
    g.release().await.unwrap();
}

#[tokio::test]
async fn a_data_node_or_a_wrong_login_where_sentinels_belong_is_a_configuration_error_that_says_why()
 {
    // A data node's address where a Sentinel belongs.
    let e = RedisBackend::connect("redis+sentinel://127.0.0.1:6379/fencelock")
        .await
        .expect_err("6379 is no Sentinel");
    assert!(
        matches!(e, Error::InvalidConfig { .. }) && e.to_string().contains("SENTINEL"),
        "the data node's own answer should show: {e:?}"
    );
    // A password the Sentinels do not have.
    let e = RedisBackend::connect(&format!(
        "redis+sentinel://{SENTINELS}/fencelock?sentinel_password=nope"
    ))
    .await
    .expect_err("the Sentinels have no password");
    assert!(
        matches!(e, Error::InvalidConfig { .. }) && e.to_string().contains("127.0.0.1:7211"),
        "{e:?}"
    );
}
