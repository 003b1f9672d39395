//! Expiry follows the server's clock, not the client's (its own test binary:
//! the clock offset is process-wide).

mod support;

use fencelock_testkit::faults;
use support::{My, SHARED};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expiry_follows_the_server_clock() {
    faults::expiry_follows_the_server_clock(&My, SHARED).await;
}
