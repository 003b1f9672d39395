//! Micro-benchmarks of the embedded default: an uncontended acquire + release
//! on a SQLite file (two `BEGIN IMMEDIATE` transactions in WAL mode), and a
//! refused try (one read-only check).
//!
//! `cargo bench -p fencelock-sqlite --bench sqlite`

use criterion::{Criterion, criterion_group, criterion_main};
use fencelock_core::Locker;
use fencelock_sqlite::SqliteBackend;

fn sqlite(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("bench.sqlite3");
    let (a, b) = rt.block_on(async {
        (
            Locker::new(SqliteBackend::open(&path).await.expect("open")),
            Locker::new(SqliteBackend::open(&path).await.expect("open")),
        )
    });

    c.bench_function("sqlite/acquire_release", |bench| {
        bench.to_async(&rt).iter(|| async {
            let g = a.lock("bench/cycle").acquire().await.expect("acquire");
            g.release().await.expect("release");
        })
    });

    let held = rt
        .block_on(a.lock("bench/busy").acquire())
        .expect("acquire");
    c.bench_function("sqlite/try_acquire_busy", |bench| {
        bench.to_async(&rt).iter(|| async {
            let r = b.lock("bench/busy").try_acquire().await.expect("try");
            assert!(r.is_none());
        })
    });
    rt.block_on(held.release()).expect("release");
}

criterion_group!(benches, sqlite);
criterion_main!(benches);
