//! Reacting to a lost lock: the work races `guard.lost()`, so it stops as soon
//! as the hold is gone instead of carrying on unprotected.
//!
//! Here the hold is lost on purpose: a lease of one second without renewal,
//! and work that takes longer. In production the same signal fires when a
//! renewal is refused, the backend cannot be reached until the deadline, or
//! the process was paused past it.
//!
//! `cargo run -p fencelock --example lost_signal`

use std::time::Duration;

#[tokio::main]
async fn main() -> fencelock::Result<()> {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let locker = fencelock::connect(&format!(
        "sqlite://{}",
        dir.path().join("locks.db").display()
    ))
    .await?;
    let guard = locker
        .lock("reports/monthly")
        .lease(Duration::from_secs(1))
        .acquire()
        .await?;

    let work = async {
        for step in 1..=5 {
            tokio::time::sleep(Duration::from_millis(400)).await;
            println!("step {step} done");
        }
    };
    tokio::select! {
        () = work => println!("finished while holding the lock"),
        lost = guard.lost() => {
            println!("stopped: {lost}");
            assert!(!guard.is_valid());
        }
    }
    Ok(())
}
