//! The database lock patterns against the shared test server.

use std::time::Duration;

use fencelock_core::{Error, FencingToken};
use fencelock_postgres::patterns::{Fenced, Versioned, explain, lock_rows};
use sqlx::PgPool;

const URL: &str = "postgres://postgres:postgres@127.0.0.1:5432/test";

async fn pool() -> PgPool {
    PgPool::connect(URL)
        .await
        .expect("the test database runs (scripts/services.sh)")
}

async fn exec(pool: &PgPool, sql: &'static str) {
    sqlx::query(sql).execute(pool).await.expect(sql);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn optimistic_writers_never_lose_an_update() {
    let pool = pool().await;
    exec(&pool, "CREATE TABLE IF NOT EXISTS t_opt (id bigint PRIMARY KEY, qty bigint NOT NULL, ver bigint NOT NULL)").await;
    exec(
        &pool,
        "INSERT INTO t_opt VALUES (1, 40, 0) ON CONFLICT (id) DO UPDATE SET qty = 40, ver = 0",
    )
    .await;
    let stock = Versioned::new("t_opt", "id", "qty", "ver").unwrap();

    // Two writers read the same version: exactly one wins.
    let (q, v): (i64, i64) = stock.read(&pool, 1).await.unwrap().unwrap();
    assert_eq!((q, v), (40, 0));
    let (a, b) = tokio::join!(
        stock.write(&pool, 1, q - 1, v),
        stock.write(&pool, 1, q - 1, v)
    );
    assert_eq!(
        a.unwrap() as u8 + b.unwrap() as u8,
        1,
        "both or neither of two same-version writers won"
    );

    // Eight concurrent decrementers, 4 each: every decrement lands once.
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let (pool, stock) = (pool.clone(), stock.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..4 {
                stock
                    .update(&pool, 1, 1000, |q: i64| Some(q - 1))
                    .await
                    .unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let (q, v): (i64, i64) = stock.read(&pool, 1).await.unwrap().unwrap();
    assert_eq!((q, v), (39 - 32, 33), "a lost update");
    // `None` from the closure leaves the row alone.
    assert_eq!(
        stock
            .update(&pool, 1, 3, |_: i64| None::<i64>)
            .await
            .unwrap(),
        None
    );
    assert!(
        stock.update(&pool, 99, 3, |q: i64| Some(q)).await.is_err(),
        "a missing row"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locked_rows_time_out_and_deadlocks_are_explained() {
    let pool = pool().await;
    exec(
        &pool,
        "CREATE TABLE IF NOT EXISTS t_rows (id bigint PRIMARY KEY, n bigint NOT NULL)",
    )
    .await;
    exec(
        &pool,
        "INSERT INTO t_rows VALUES (1, 0), (2, 0) ON CONFLICT (id) DO UPDATE SET n = 0",
    )
    .await;

    let mut first = lock_rows(&pool, "t_rows", "id", &[1], Duration::from_secs(2))
        .await
        .unwrap();
    let busy = lock_rows(&pool, "t_rows", "id", &[2, 1], Duration::from_millis(200)).await;
    assert!(
        matches!(busy, Err(Error::Timeout { .. })),
        "expected Timeout, got {busy:?}"
    );
    sqlx::query("UPDATE t_rows SET n = n + 1 WHERE id = 1")
        .execute(first.conn())
        .await
        .unwrap();
    first.commit().await.unwrap();
    let second = lock_rows(&pool, "t_rows", "id", &[2, 1], Duration::from_millis(200))
        .await
        .unwrap();
    second.commit().await.unwrap();

    // Two transactions locking two rows in opposite orders: the server aborts one.
    let (mut t1, mut t2) = (pool.begin().await.unwrap(), pool.begin().await.unwrap());
    let lock = |id: i64| sqlx::query("SELECT 1 FROM t_rows WHERE id = $1 FOR UPDATE").bind(id);
    lock(1).execute(&mut *t1).await.unwrap();
    lock(2).execute(&mut *t2).await.unwrap();
    let (r1, r2) = tokio::join!(lock(2).execute(&mut *t1), lock(1).execute(&mut *t2));
    let failed: Vec<sqlx::Error> = [r1, r2].into_iter().filter_map(Result::err).collect();
    assert_eq!(failed.len(), 1, "one side of the deadlock must be aborted");
    let msg = explain(
        "rows 1 and 2",
        Duration::ZERO,
        failed.into_iter().next().unwrap(),
    )
    .to_string();
    assert!(
        msg.contains("deadlock") && msg.contains("one order"),
        "{msg}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fenced_writes_refuse_older_tokens() {
    let pool = pool().await;
    exec(&pool, "CREATE TABLE IF NOT EXISTS t_fenced (id bigint PRIMARY KEY, body text NOT NULL, last_token bigint NOT NULL)").await;
    exec(&pool, "DELETE FROM t_fenced").await;
    let files = Fenced::new("t_fenced", "id", "body", "last_token").unwrap();
    assert!(
        files
            .write(&pool, 1, "five", FencingToken::new(5))
            .await
            .unwrap()
    );
    assert!(
        !files
            .write(&pool, 1, "four", FencingToken::new(4))
            .await
            .unwrap()
    );
    assert!(
        !files
            .write(&pool, 1, "five again", FencingToken::new(5))
            .await
            .unwrap()
    );
    assert!(
        files
            .write(&pool, 1, "six", FencingToken::new(6))
            .await
            .unwrap()
    );
    let body: String = sqlx::query_scalar("SELECT body FROM t_fenced WHERE id = 1")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(body, "six");
    assert!(
        files
            .write(&pool, 1, "huge", FencingToken::new(u64::MAX))
            .await
            .is_err()
    );
}
