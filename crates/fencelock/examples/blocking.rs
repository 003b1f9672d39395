//! The same locks from plain threads, without an async runtime (feature
//! `blocking`): a runtime of its own renews the guards.
//!
//! `cargo run -p fencelock --features blocking --example blocking`

use std::time::Duration;

fn main() -> fencelock::Result<()> {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let url = format!("sqlite://{}", dir.path().join("locks.db").display());
    let locker = fencelock::blocking::Locker::connect(&url)?;

    let guard = locker
        .lock("orders/42")
        .ttl(Duration::from_secs(30))
        .acquire()?;
    println!(
        "holding orders/42 with token {}",
        guard.token().expect("sqlite fences")
    );

    // Another thread tries the same key once: it is busy.
    let other = locker.clone();
    let busy = std::thread::spawn(move || other.lock("orders/42").try_acquire())
        .join()
        .expect("the other thread")?;
    assert!(busy.is_none());
    println!("another thread found it busy");

    guard.release()
}
