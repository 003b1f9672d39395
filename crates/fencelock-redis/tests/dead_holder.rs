//! The testkit's holder-process scenarios on single Redis, the 3-master
//! cluster and Redlock over 5 instances: a SIGKILLed holder frees its lock
//! after about its own TTL, and a SIGSTOPped one loses it, with its stale
//! fenced write rejected.

use fencelock_core::backend::async_trait;
use fencelock_core::{FencingToken, Locker, Result};
use fencelock_redis::{RedisBackend, RedlockBackend};
use fencelock_testkit::faults::{self, FaultHarness};

const SINGLE: &str = "redis://127.0.0.1:6379";
const CLUSTER: &str = "redis+cluster://127.0.0.1:7101,127.0.0.1:7102,127.0.0.1:7103";
const REDLOCK: &str =
    "redlock://127.0.0.1:7001,127.0.0.1:7002,127.0.0.1:7003,127.0.0.1:7004,127.0.0.1:7005";

/// Connects by the URL's scheme; the protected resource lives on the single
/// Redis (`fenced_set`).
struct Redis;

#[async_trait]
impl FaultHarness for Redis {
    async fn locker(&self, url: &str) -> Result<Locker> {
        Ok(if url.starts_with("redlock://") {
            Locker::new(RedlockBackend::connect(url).await?)
        } else {
            Locker::new(RedisBackend::connect(url).await?)
        })
    }

    async fn fenced_write(&self, key: &str, token: FencingToken) -> Result<bool> {
        let resource = format!("fencelock-test-resource:{key}");
        RedisBackend::connect(SINGLE)
            .await?
            .fenced_set(&resource, token, "written")
            .await
    }
}

#[test]
#[ignore = "holder process of the testkit's SIGKILL and SIGSTOP scenarios"]
fn holder_worker() {
    faults::holder_worker(Redis);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_holder_frees_the_lock_after_its_ttl() {
    faults::killed_holder_frees_after_its_ttl(&Redis, SINGLE).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_holder_frees_the_lock_after_its_ttl_on_the_cluster() {
    faults::killed_holder_frees_after_its_ttl(&Redis, CLUSTER).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_holder_frees_the_lock_after_its_ttl_on_redlock() {
    faults::killed_holder_frees_after_its_ttl(&Redis, REDLOCK).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_holder_loses_its_lock_and_its_stale_write() {
    faults::paused_holder_loses_its_lock_and_its_stale_write(&Redis, SINGLE).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_holder_loses_its_lock_and_its_stale_write_on_the_cluster() {
    faults::paused_holder_loses_its_lock_and_its_stale_write(&Redis, CLUSTER).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_holder_loses_its_lock_and_its_stale_write_on_redlock() {
    faults::paused_holder_loses_its_lock_and_its_stale_write(&Redis, REDLOCK).await;
}

/// A silent server (a frozen VM, a cut cable) cannot keep a waiter past its
/// wait, nor a connect running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_server_cannot_hold_a_waiter_past_its_wait() {
    faults::a_stalled_server_cannot_hold_a_waiter_past_its_deadline(&Redis, SINGLE).await;
}

/// A silent server (a frozen VM, a cut cable) cannot keep a waiter past its
/// wait, nor a connect running (one of the five instances silent).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_instance_cannot_hold_a_redlock_waiter_past_its_wait() {
    faults::a_stalled_server_cannot_hold_a_waiter_past_its_deadline(&Redis, REDLOCK).await;
}
