//! Several keys at once, all or nothing: a transfer locks both accounts. The
//! keys are taken in one order whatever order they are given in, so two
//! transfers in opposite directions cannot deadlock.
//!
//! `cargo run -p fencelock --example multi_lock`

use std::time::Duration;

#[tokio::main]
async fn main() -> fencelock::Result<()> {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let locker = fencelock::connect(&format!(
        "sqlite://{}",
        dir.path().join("locks.db").display()
    ))
    .await?;

    let transfer = |from: &'static str, to: &'static str| {
        let locker = locker.clone();
        async move {
            let both = locker
                .multi_lock([from, to])
                .wait(Duration::from_secs(10))
                .acquire()
                .await?;
            for (key, token) in both.tokens() {
                let token = token.expect("sqlite fences");
                println!("{from} → {to}: holds {key} with token {token}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            both.release().await
        }
    };
    // Opposite directions at once: both finish.
    let (x, y) = tokio::join!(
        transfer("accounts/alice", "accounts/bob"),
        transfer("accounts/bob", "accounts/alice")
    );
    x?;
    y?;
    println!("both transfers done");
    Ok(())
}
