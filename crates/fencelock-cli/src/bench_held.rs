//! `fencelock bench --scenario held --locks N`: N keys acquired on one
//! `Locker` and held through several renewal periods. Reports the acquire
//! throughput, the renewal calls per tick the watchdog makes (counted by a
//! wrapper around the backend), the time they take, the client memory per
//! held lock (the process's RSS before and after), and the holds lost.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use fencelock::backend::{Backoff, Grant, LeaseRef, Released, Renewal, Request, async_trait};
use fencelock::{Backend, Capabilities, Guard, Key, LockInfo, Locker, Result};
use serde_json::json;

use crate::bench::{RunResult, percentile_ms, progress};
use crate::cli::BenchArgs;

/// The TTL of every held lock: renewed every 2 s (ttl/3).
const HELD_TTL: Duration = Duration::from_secs(6);
/// How long the locks are held once all are taken: four renewal periods.
const HOLD: Duration = Duration::from_secs(8);

/// What the renewals cost, counted around the backend.
#[derive(Default)]
struct RenewStats {
    calls: AtomicU64,
    leases: AtomicU64,
    busy_ns: AtomicU64,
}

impl RenewStats {
    fn snapshot(&self) -> (u64, u64, u64) {
        (
            self.calls.load(Ordering::SeqCst),
            self.leases.load(Ordering::SeqCst),
            self.busy_ns.load(Ordering::SeqCst),
        )
    }
}

/// A backend that counts its `renew` calls and forwards everything.
struct Counting {
    inner: Arc<dyn Backend>,
    stats: Arc<RenewStats>,
}

#[async_trait]
impl Backend for Counting {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    fn address(&self) -> String {
        self.inner.address()
    }

    fn default_ttl(&self) -> Option<Duration> {
        self.inner.default_ttl()
    }

    async fn try_acquire(&self, req: &Request) -> Result<Option<Grant>> {
        self.inner.try_acquire(req).await
    }

    async fn renew(&self, leases: &[LeaseRef]) -> Result<Vec<Renewal>> {
        let start = Instant::now();
        let r = self.inner.renew(leases).await;
        self.stats.calls.fetch_add(1, Ordering::SeqCst);
        self.stats
            .leases
            .fetch_add(leases.len() as u64, Ordering::SeqCst);
        self.stats
            .busy_ns
            .fetch_add(start.elapsed().as_nanos() as u64, Ordering::SeqCst);
        r
    }

    async fn release(&self, lease: &LeaseRef) -> Result<Released> {
        self.inner.release(lease).await
    }

    async fn release_to(
        &self,
        lease: &LeaseRef,
        next: &Request,
    ) -> Result<(Released, Option<Grant>)> {
        self.inner.release_to(lease, next).await
    }

    fn session_events(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        self.inner.session_events()
    }

    async fn acquire(
        &self,
        req: &Request,
        deadline: Option<tokio::time::Instant>,
    ) -> Result<Option<Grant>> {
        self.inner.acquire(req, deadline).await
    }

    async fn wait_change(
        &self,
        key: &Key,
        backoff: &mut Backoff,
        deadline: Option<tokio::time::Instant>,
    ) -> Result<()> {
        self.inner.wait_change(key, backoff, deadline).await
    }

    async fn inspect(&self, key: &Key) -> Result<Option<LockInfo>> {
        self.inner.inspect(key).await
    }

    async fn list(&self, prefix: &str) -> Result<Vec<LockInfo>> {
        self.inner.list(prefix).await
    }
}

/// Hands the heap memory freed so far back to the system (glibc's
/// `malloc_trim`), so that the RSS read next counts what live objects use,
/// not what the allocator keeps from the burst of acquires.
fn trim_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases free memory of the allocator in use
    // (glibc's, which this build links); it touches no live allocation.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// The bytes live on the heap, when the build counts them (feature `heap-count`).
fn heap_bytes() -> Option<u64> {
    #[cfg(feature = "heap-count")]
    return Some(crate::heap_count::live_bytes() as u64);
    #[cfg(not(feature = "heap-count"))]
    None
}

/// The process's resident memory, in bytes (Linux: `/proc/self/status`).
fn rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kb * 1024)
}

/// Takes `locks` keys with `workers` tasks; returns the guards, the acquire
/// latencies, the errors and the seconds it took.
async fn take_all(
    locker: &Locker,
    prefix: &str,
    locks: u64,
    workers: u32,
) -> (Vec<Guard>, Vec<Duration>, Vec<String>, f64) {
    let pb = progress(locks, format!("{} held", locker.backend().name()));
    let next = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let tasks: Vec<_> = (0..workers.max(1))
        .map(|_| {
            let (locker, next, pb, prefix) =
                (locker.clone(), next.clone(), pb.clone(), prefix.to_string());
            tokio::spawn(async move {
                let (mut guards, mut lat, mut errors) = (Vec::new(), Vec::new(), Vec::new());
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    if i >= locks {
                        return (guards, lat, errors);
                    }
                    let t0 = Instant::now();
                    match locker
                        .lock(format!("{prefix}{i}"))
                        .ttl(HELD_TTL)
                        .acquire()
                        .await
                    {
                        Ok(g) => {
                            lat.push(t0.elapsed());
                            guards.push(g);
                        }
                        Err(e) => errors.push(e.to_string()),
                    }
                    pb.inc(1);
                }
            })
        })
        .collect();
    let (mut guards, mut lat, mut errors) = (Vec::new(), Vec::new(), Vec::new());
    for t in tasks {
        match t.await {
            Ok((g, l, e)) => {
                guards.extend(g);
                lat.extend(l);
                errors.extend(e);
            }
            Err(e) => errors.push(format!("worker panicked: {e}")),
        }
    }
    let secs = start.elapsed().as_secs_f64();
    pb.finish_and_clear();
    (guards, lat, errors, secs)
}

/// Releases every guard, `workers` at a time.
async fn release_all(guards: Vec<Guard>, workers: u32) -> Vec<String> {
    let per = guards.len().div_ceil(workers.max(1) as usize).max(1);
    let mut tasks = Vec::new();
    let mut guards = guards;
    while !guards.is_empty() {
        let chunk: Vec<Guard> = guards.drain(..per.min(guards.len())).collect();
        tasks.push(tokio::spawn(async move {
            let mut errors = Vec::new();
            for g in chunk {
                if let Err(e) = g.release().await {
                    errors.push(e.to_string());
                }
            }
            errors
        }));
    }
    let mut errors = Vec::new();
    for t in tasks {
        errors.extend(
            t.await
                .unwrap_or_else(|e| vec![format!("worker panicked: {e}")]),
        );
    }
    errors
}

/// One held-locks run on `url`.
pub async fn run(url: &str, args: &BenchArgs, run_id: &str) -> Result<RunResult> {
    let stats = Arc::new(RenewStats::default());
    let backend = fencelock::connect_backend(url).await?;
    let locker = Locker::new(Counting {
        inner: backend,
        stats: stats.clone(),
    });
    let name = locker.backend().name().to_string();
    let prefix = format!("bench/{run_id}/held/");
    trim_heap();
    let (before, heap_before) = (rss_bytes(), heap_bytes());
    let (guards, mut lat, mut errors, secs) =
        take_all(&locker, &prefix, args.locks, args.workers).await;
    let (after, heap_after) = (rss_bytes(), heap_bytes());
    trim_heap();
    let trimmed = rss_bytes();
    let (calls0, leases0, busy0) = stats.snapshot();
    tokio::time::sleep(HOLD).await;
    let (calls1, leases1, busy1) = stats.snapshot();
    let held = guards.iter().filter(|g| g.is_valid()).count() as u64;
    let lost = guards.len() as u64 - held;
    errors.extend(release_all(guards, args.workers).await);
    lat.sort_unstable();
    // Every held lock is renewed once per tick: the ticks are the leases
    // renewed over the locks held.
    let ticks = (leases1 - leases0) as f64 / args.locks.max(1) as f64;
    let per_tick = |v: u64| if ticks > 0.0 { v as f64 / ticks } else { 0.0 };
    let calls_per_tick = per_tick(calls1 - calls0);
    let per_lock = |before: Option<u64>, after: Option<u64>| match (before, after) {
        (Some(b), Some(a)) => json!(a.saturating_sub(b) / args.locks.max(1)),
        _ => json!(null),
    };
    let extra = json!({
        "locks": args.locks,
        "hold_secs": HOLD.as_secs_f64(),
        "renew_ticks": (ticks * 100.0).round() / 100.0,
        "renew_calls_per_tick": (calls_per_tick * 100.0).round() / 100.0,
        "renew_calls_per_100_locks_per_tick": (calls_per_tick * 100.0 / args.locks.max(1) as f64 * 1000.0).round() / 1000.0,
        "renew_ms_per_tick": (per_tick(busy1 - busy0) / 1e4).round() / 100.0,
        "rss_bytes_per_lock": per_lock(before, after),
        "rss_trimmed_bytes_per_lock": per_lock(before, trimmed),
        "heap_bytes_per_lock": per_lock(heap_before, heap_after),
        "lost": lost,
    });
    Ok(RunResult {
        backend: name,
        url: fencelock::backend::redact_url(url),
        scenario: "held",
        workers: args.workers,
        processes: 1,
        ops: args.locks,
        secs,
        p50_ms: percentile_ms(&lat, 0.50),
        p99_ms: percentile_ms(&lat, 0.99),
        max_ms: lat.last().map_or(0.0, |d| d.as_secs_f64() * 1e3),
        owner_switches: None,
        final_counter: held,
        expected_counter: args.locks,
        errors,
        latency_kind: "acquire",
        extra: Some(extra),
    })
}
