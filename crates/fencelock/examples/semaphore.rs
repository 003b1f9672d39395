//! A semaphore: at most N holders at once, here 2 of 6 workers calling a
//! rate-limited service.
//!
//! `cargo run -p fencelock --example semaphore`

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

#[tokio::main]
async fn main() -> fencelock::Result<()> {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let locker = fencelock::connect(&format!(
        "sqlite://{}",
        dir.path().join("locks.db").display()
    ))
    .await?;
    let (now, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let workers: Vec<_> = (0..6)
        .map(|i| {
            let (locker, now, most) = (locker.clone(), now.clone(), most.clone());
            tokio::spawn(async move {
                let permit = locker.semaphore("api/partner", 2).acquire().await?;
                let inside = now.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(inside, Ordering::SeqCst);
                println!("worker {i} calls the service ({inside} inside)");
                tokio::time::sleep(Duration::from_millis(200)).await;
                now.fetch_sub(1, Ordering::SeqCst);
                permit.release().await
            })
        })
        .collect();
    for w in workers {
        w.await.expect("a worker task")?;
    }
    let most = most.load(Ordering::SeqCst);
    println!("at most {most} workers were inside at once");
    assert!(most <= 2);
    Ok(())
}
