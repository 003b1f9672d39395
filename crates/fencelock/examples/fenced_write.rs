//! Why fencing tokens: a holder pauses past its lease, another holder takes
//! the lock and writes, and the first one's late write is refused by the
//! fenced update `UPDATE … WHERE last_token < ?`.
//!
//! `cargo run -p fencelock --example fenced_write`

use std::time::Duration;

use rusqlite::{Connection, params};

/// Writes `state` only if no holder with a newer token wrote before.
fn fenced_update(db: &Connection, state: &str, token: u64) -> rusqlite::Result<bool> {
    let changed = db.execute(
        "UPDATE orders SET state = ?1, last_token = ?2 WHERE id = 42 AND last_token < ?2",
        params![state, token as i64],
    )?;
    Ok(changed == 1)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let locker = fencelock::connect(&format!(
        "sqlite://{}",
        dir.path().join("locks.db").display()
    ))
    .await?;
    // The resource: a row that remembers the newest token that wrote it.
    let db = Connection::open(dir.path().join("shop.db"))?;
    db.execute_batch(
        "CREATE TABLE orders (id INTEGER PRIMARY KEY, state TEXT, last_token INTEGER NOT NULL);
         INSERT INTO orders VALUES (42, 'new', 0);",
    )?;

    // A holds a lease of one second without renewal, then stalls (a GC pause,
    // a frozen VM) for longer than that.
    let a = locker
        .lock("orders/42")
        .lease(Duration::from_secs(1))
        .acquire()
        .await?;
    let token_a = a.token().expect("sqlite fences").get();
    tokio::time::sleep(Duration::from_millis(1500)).await;

    // Meanwhile the lease ran out and B took the lock and wrote.
    let b = locker.lock("orders/42").acquire().await?;
    let token_b = b.token().expect("sqlite fences").get();
    assert!(fenced_update(&db, "paid by B", token_b)?);
    b.release().await?;

    // A wakes up and writes what it decided before the pause: refused.
    let applied = fenced_update(&db, "cancelled by A", token_a)?;
    println!("A's write with token {token_a} after B's {token_b}: applied = {applied}");
    assert!(!applied, "a stale write went through");
    let state: String = db.query_row("SELECT state FROM orders WHERE id = 42", [], |r| r.get(0))?;
    assert_eq!(state, "paid by B");
    println!("the order says {state:?}");
    drop(a);
    Ok(())
}
