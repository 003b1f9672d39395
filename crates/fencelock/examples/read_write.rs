//! A read-write lock: readers share it, a writer waits until they are gone,
//! and readers that come while a writer waits queue behind the writer.
//!
//! `cargo run -p fencelock --example read_write`

use std::time::Duration;

#[tokio::main]
async fn main() -> fencelock::Result<()> {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let locker = fencelock::connect(&format!(
        "sqlite://{}",
        dir.path().join("locks.db").display()
    ))
    .await?;

    let r1 = locker.read_lock("catalog").acquire().await?;
    let r2 = locker.read_lock("catalog").acquire().await?;
    println!("two readers hold the catalog at once");

    let writer = {
        let locker = locker.clone();
        tokio::spawn(async move {
            let w = locker
                .lock("catalog")
                .wait(Duration::from_secs(10))
                .acquire()
                .await?;
            println!(
                "the writer holds it alone (token {})",
                w.token().expect("sqlite fences")
            );
            w.release().await
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !writer.is_finished(),
        "the writer got in beside the readers"
    );
    println!("the writer waits for the readers");
    r1.release().await?;
    r2.release().await?;
    writer.await.expect("the writer task")?;
    Ok(())
}
