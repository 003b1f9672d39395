//! Micro-benchmarks of the core's own costs, on the in-memory backend (no I/O):
//! key validation, an uncontended acquire + release through [`Locker`] (guard,
//! watchdog registration, local line, tracing span), a refused try, and a
//! reentrant acquire.
//!
//! `cargo bench -p fencelock-core --bench locker`

use criterion::{Criterion, criterion_group, criterion_main};
use fencelock_core::{Key, Locker, MemoryBackend};

fn locker(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let locker = rt.block_on(async { Locker::new(MemoryBackend::new()) });

    c.bench_function("key/validate", |b| {
        b.iter(|| Key::new(std::hint::black_box("orders/2026/11/30/42")))
    });

    c.bench_function("memory/acquire_release", |b| {
        b.to_async(&rt).iter(|| async {
            let g = locker.lock("bench/cycle").acquire().await.expect("acquire");
            g.release().await.expect("release");
        })
    });

    let held = rt
        .block_on(locker.lock("bench/busy").acquire())
        .expect("acquire");
    c.bench_function("memory/try_acquire_busy", |b| {
        b.to_async(&rt).iter(|| async {
            let r = locker.lock("bench/busy").try_acquire().await.expect("try");
            assert!(r.is_none());
        })
    });
    rt.block_on(held.release()).expect("release");

    let owner = "bench-owner";
    let outer = rt
        .block_on(locker.lock("bench/reentrant").owner(owner).acquire())
        .expect("acquire");
    c.bench_function("memory/reentrant_acquire_release", |b| {
        b.to_async(&rt).iter(|| async {
            let g = locker
                .lock("bench/reentrant")
                .owner(owner)
                .acquire()
                .await
                .expect("reenter");
            g.release().await.expect("release");
        })
    });
    rt.block_on(outer.release()).expect("release");
}

criterion_group!(benches, locker);
criterion_main!(benches);
