//! The metrics a known sequence of operations records (the `metrics`
//! feature), read back with a debugging recorder installed for this process.

use std::time::Duration;

use fencelock_core::{Key, Locker, MemoryBackend};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use metrics_util::{CompositeKey, MetricKind};

/// Every snapshot taken. A snapshot drains what it reads (counters and gauges
/// to zero, histograms empty), so a value is the sum over all of them.
#[derive(Default)]
struct Readings(Vec<(CompositeKey, DebugValue)>);

impl Readings {
    fn take(&mut self, s: &Snapshotter) {
        self.0.extend(
            s.snapshot()
                .into_vec()
                .into_iter()
                .map(|(k, _, _, v)| (k, v)),
        );
    }

    /// The values of the metric `name` whose labels include `labels`.
    fn values<'a>(
        &'a self,
        kind: MetricKind,
        name: &'a str,
        labels: &'a [(&str, &str)],
    ) -> impl Iterator<Item = &'a DebugValue> {
        self.0
            .iter()
            .filter(move |(k, _)| {
                k.kind() == kind
                    && k.key().name() == name
                    && labels
                        .iter()
                        .all(|(l, v)| k.key().labels().any(|x| x.key() == *l && x.value() == *v))
            })
            .map(|(_, v)| v)
    }

    fn counter(&self, name: &str, labels: &[(&str, &str)]) -> u64 {
        self.values(MetricKind::Counter, name, labels)
            .map(|v| match v {
                DebugValue::Counter(n) => *n,
                _ => 0,
            })
            .sum()
    }

    fn samples(&self, name: &str, labels: &[(&str, &str)]) -> usize {
        self.values(MetricKind::Histogram, name, labels)
            .map(|v| match v {
                DebugValue::Histogram(xs) => xs.len(),
                _ => 0,
            })
            .sum()
    }

    fn gauge(&self, name: &str) -> f64 {
        self.values(MetricKind::Gauge, name, &[("backend", "memory")])
            .map(|v| match v {
                DebugValue::Gauge(g) => g.into_inner(),
                _ => 0.0,
            })
            .sum()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_known_sequence_records_what_happened() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder
        .install()
        .expect("the only recorder of this test process");
    let mem = MemoryBackend::new();
    let a = Locker::new(mem.clone());
    let b = Locker::new(mem.clone());
    let m = [("backend", "memory")];

    // Granted, busy, timeout; one hold released, one dropped.
    let g = a.lock("k").acquire().await.unwrap();
    assert!(b.lock("k").try_acquire().await.unwrap().is_none());
    let e = b.lock("k").wait(Duration::from_millis(200)).acquire().await;
    assert!(e.is_err());
    g.release().await.unwrap();
    drop(b.lock("k").try_acquire().await.unwrap().unwrap());

    // A waiter of the same locker: counted while it waits, then handed the
    // lock by the release.
    let first = a.lock("h").acquire().await.unwrap();
    let waiter = tokio::spawn({
        let a = a.clone();
        async move { a.lock("h").acquire().await }
    });
    let mut r = Readings::default();
    let start = std::time::Instant::now();
    loop {
        r.take(&snapshotter);
        if r.gauge("fencelock_waiters") >= 1.0 {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the waiter never counted"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    first.release().await.unwrap();
    waiter.await.unwrap().unwrap().release().await.unwrap();

    // A hold the backend loses: the watchdog's renewal finds it gone.
    let lost = a
        .lock("l")
        .ttl(Duration::from_secs(1))
        .acquire()
        .await
        .unwrap();
    mem.force_release(&Key::new("l").unwrap());
    let _ = tokio::time::timeout(Duration::from_secs(30), lost.lost())
        .await
        .expect("the lease was never reported lost");
    drop(lost);

    // A fixed lease that ran out unnoticed, then released: lost, not released.
    let fixed = a
        .lock("f")
        .lease(Duration::from_secs(1))
        .acquire()
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let _ = fixed.release().await;

    r.take(&snapshotter);
    let wait = "fencelock_acquire_wait_seconds";
    // k (a), k (b, after), h (first), h (waiter), l, f.
    assert_eq!(r.samples(wait, &[m[0], ("outcome", "granted")]), 6);
    assert_eq!(r.samples(wait, &[m[0], ("outcome", "busy")]), 1);
    assert_eq!(r.samples(wait, &[m[0], ("outcome", "timeout")]), 1);
    assert_eq!(r.samples(wait, &[m[0], ("outcome", "error")]), 0);
    assert_eq!(r.samples("fencelock_hold_seconds", &m), 6);
    assert_eq!(r.counter("fencelock_handoffs_total", &m), 1);
    assert_eq!(
        r.counter(
            "fencelock_leases_lost_total",
            &[m[0], ("reason", "not_held")]
        ),
        1
    );
    // Released and dropped guards are not lost leases; the fixed lease is.
    assert_eq!(
        r.counter(
            "fencelock_leases_lost_total",
            &[m[0], ("reason", "expired")]
        ),
        1
    );
    assert_eq!(
        r.counter("fencelock_renewals_total", &[m[0], ("outcome", "lost")]),
        1
    );
    assert_eq!(r.gauge("fencelock_waiters"), 0.0);
}
