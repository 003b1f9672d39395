//! `fencelock bench`: uncontended, contended and handoff workloads on one or
//! more backends, with the JSON lines of ARCHITECTURE.md §5.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fencelock::Locker;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::json;
use tokio::sync::Barrier;

use crate::cli::{BenchArgs, Scenario};
use crate::exit;

/// The lease of every bench hold: long enough that expiry never plays a part.
const BENCH_TTL: Duration = Duration::from_secs(30);

/// One run of one scenario on one backend.
#[derive(Debug, Clone)]
pub struct RunResult {
    pub backend: String,
    pub url: String,
    pub scenario: &'static str,
    pub workers: u32,
    pub processes: u32,
    pub ops: u64,
    pub secs: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    pub owner_switches: Option<usize>,
    pub final_counter: u64,
    pub expected_counter: u64,
    pub errors: Vec<String>,
    pub latency_kind: &'static str,
    /// Fields of the scenario's own (`held`), added to the JSON line.
    pub extra: Option<serde_json::Value>,
}

impl RunResult {
    pub fn ops_per_sec(&self) -> f64 {
        if self.secs > 0.0 {
            self.ops as f64 / self.secs
        } else {
            0.0
        }
    }

    pub fn correct(&self) -> bool {
        self.errors.is_empty() && self.final_counter == self.expected_counter
    }

    fn to_json(&self) -> serde_json::Value {
        let round = |v: f64, places: i32| {
            let f = 10f64.powi(places);
            (v * f).round() / f
        };
        let mut v = json!({
            "system": "fencelock",
            "backend": self.backend,
            "scenario": self.scenario,
            "workers": self.workers,
            "processes": self.processes,
            "ops": self.ops,
            "secs": round(self.secs, 4),
            "ops_per_sec": round(self.ops_per_sec(), 1),
            "p50_ms": round(self.p50_ms, 4),
            "p99_ms": round(self.p99_ms, 4),
            "max_ms": round(self.max_ms, 4),
            "owner_switches": self.owner_switches,
            "final_counter": self.final_counter,
            "expected_counter": self.expected_counter,
            "correct": self.correct(),
            "latency_kind": self.latency_kind,
            "url": self.url,
        });
        if !self.errors.is_empty() {
            v["errors"] = json!(self.errors.iter().take(5).collect::<Vec<_>>());
        }
        if let Some(serde_json::Value::Object(extra)) = &self.extra {
            for (k, x) in extra {
                v[k] = x.clone();
            }
        }
        v
    }
}

pub(crate) fn percentile_ms(sorted: &[Duration], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1].as_secs_f64() * 1e3
}

pub(crate) fn progress(total: u64, label: String) -> ProgressBar {
    let pb = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
    if let Ok(style) =
        ProgressStyle::with_template("{prefix:>28} {bar:30} {pos}/{len} {per_sec:>12} eta {eta}")
    {
        pb.set_style(style);
    }
    pb.set_prefix(label);
    pb
}

/// What the workers of one run hand back.
struct Samples {
    latencies: Vec<Duration>,
    order: Vec<u32>,
    counter: u64,
    errors: Vec<String>,
    secs: f64,
}

async fn uncontended(locker: Locker, key: String, cycles: u64, pb: ProgressBar) -> Samples {
    let key = key.as_str();
    let mut latencies = Vec::with_capacity(cycles as usize);
    let mut errors = Vec::new();
    let mut done = 0;
    let start = Instant::now();
    for _ in 0..cycles {
        let t0 = Instant::now();
        let r = async {
            let g = locker.lock(key).ttl(BENCH_TTL).acquire().await?;
            g.release().await
        }
        .await;
        match r {
            Ok(()) => {
                latencies.push(t0.elapsed());
                done += 1;
            }
            Err(e) => errors.push(e.to_string()),
        }
        pb.inc(1);
    }
    Samples {
        latencies,
        order: Vec::new(),
        counter: done,
        errors,
        secs: start.elapsed().as_secs_f64(),
    }
}

/// W workers on one key. Each cycle acquires, does an unprotected
/// read-yield-write of a shared counter, and releases. Latency is the acquire
/// wait, or with `handoff` the time from the previous holder's release to this
/// grant.
async fn contended(
    locker: &Locker,
    key: &str,
    workers: u32,
    cycles: u64,
    handoff: bool,
    pb: &ProgressBar,
) -> Samples {
    let counter = Arc::new(AtomicU64::new(0));
    let order = Arc::new(Mutex::new(Vec::with_capacity(cycles as usize)));
    let last_release: Arc<Mutex<Option<Instant>>> = Arc::new(Mutex::new(None));
    let barrier = Arc::new(Barrier::new(workers as usize + 1));
    let mut tasks = Vec::new();
    for w in 0..workers {
        let share =
            cycles / u64::from(workers) + u64::from(u64::from(w) < cycles % u64::from(workers));
        let (locker, key, counter, order, last_release, barrier, pb) = (
            locker.clone(),
            key.to_string(),
            counter.clone(),
            order.clone(),
            last_release.clone(),
            barrier.clone(),
            pb.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::with_capacity(share as usize);
            let mut errors = Vec::new();
            barrier.wait().await;
            for _ in 0..share {
                let t0 = Instant::now();
                let g = match locker.lock(&key).ttl(BENCH_TTL).acquire().await {
                    Ok(g) => g,
                    Err(e) => {
                        errors.push(e.to_string());
                        continue;
                    }
                };
                let granted = Instant::now();
                let released_at = last_release
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .take();
                order.lock().unwrap_or_else(|p| p.into_inner()).push(w);
                if handoff {
                    if let Some(r) = released_at {
                        latencies.push(granted - r);
                    }
                } else {
                    latencies.push(granted - t0);
                }
                let v = counter.load(Ordering::SeqCst);
                tokio::task::yield_now().await;
                counter.store(v + 1, Ordering::SeqCst);
                *last_release.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
                if let Err(e) = g.release().await {
                    errors.push(e.to_string());
                }
                pb.inc(1);
            }
            (latencies, errors)
        }));
    }
    barrier.wait().await;
    let start = Instant::now();
    let mut latencies = Vec::with_capacity(cycles as usize);
    let mut errors = Vec::new();
    for t in tasks {
        match t.await {
            Ok((l, e)) => {
                latencies.extend(l);
                errors.extend(e);
            }
            Err(e) => errors.push(format!("worker panicked: {e}")),
        }
    }
    let secs = start.elapsed().as_secs_f64();
    let order = order.lock().unwrap_or_else(|p| p.into_inner()).clone();
    Samples {
        latencies,
        order,
        counter: counter.load(Ordering::SeqCst),
        errors,
        secs,
    }
}

async fn run_one(
    locker: &Locker,
    url: &str,
    scenario: Scenario,
    args: &BenchArgs,
    run_id: &str,
) -> RunResult {
    let (name, default_cycles, workers, kind) = match scenario {
        Scenario::Uncontended => ("uncontended", 5000, 1, "cycle"),
        Scenario::Contended => ("contended", 2000, args.workers, "acquire_wait"),
        _ => ("handoff", 1000, args.workers, "release_to_grant"),
    };
    let cycles = args.cycles.unwrap_or(default_cycles);
    let backend = locker.backend().name().to_string();
    let key = format!("bench/{run_id}/{name}");
    let pb = progress(cycles, format!("{backend} {name}"));
    let processes = if scenario == Scenario::Uncontended {
        1
    } else {
        args.processes.min(workers)
    };
    let samples = match scenario {
        _ if processes > 1 => {
            let merged = crate::bench_procs::run(url, &key, workers, cycles, processes).await;
            pb.set_position(merged.holds.len() as u64);
            Samples {
                latencies: merged.latencies(scenario == Scenario::Handoff),
                order: merged.order(),
                counter: merged.counter,
                secs: merged.secs(),
                errors: merged.errors,
            }
        }
        // On a worker thread of the runtime, like the tasks of the other scenarios
        // (and not on the thread that blocks on the runtime).
        Scenario::Uncontended => {
            match tokio::spawn(uncontended(locker.clone(), key.clone(), cycles, pb.clone())).await {
                Ok(s) => s,
                Err(e) => Samples {
                    latencies: Vec::new(),
                    order: Vec::new(),
                    counter: 0,
                    errors: vec![format!("worker panicked: {e}")],
                    secs: 0.0,
                },
            }
        }
        Scenario::Contended => contended(locker, &key, workers, cycles, false, &pb).await,
        _ => contended(locker, &key, workers, cycles, true, &pb).await,
    };
    pb.finish_and_clear();
    let mut lat = samples.latencies;
    lat.sort_unstable();
    let owner_switches = (scenario != Scenario::Uncontended)
        .then(|| samples.order.windows(2).filter(|w| w[0] != w[1]).count());
    RunResult {
        backend,
        url: fencelock::backend::redact_url(url),
        scenario: name,
        workers,
        processes,
        ops: cycles,
        secs: samples.secs,
        p50_ms: percentile_ms(&lat, 0.50),
        p99_ms: percentile_ms(&lat, 0.99),
        max_ms: lat.last().map_or(0.0, |d| d.as_secs_f64() * 1e3),
        owner_switches,
        final_counter: samples.counter,
        expected_counter: cycles,
        errors: samples.errors,
        latency_kind: kind,
        extra: None,
    }
}

fn table(results: &[RunResult]) -> String {
    let mut out = format!(
        "{:<10} {:<12} {:>7} {:>6} {:>8} {:>10} {:>8} {:>8} {:>8} {:>9}  correct\n",
        "backend",
        "scenario",
        "workers",
        "ops",
        "secs",
        "ops/s",
        "p50 ms",
        "p99 ms",
        "max ms",
        "switches"
    );
    for r in results {
        out.push_str(&format!(
            "{:<10} {:<12} {:>7} {:>6} {:>8.3} {:>10.1} {:>8.3} {:>8.3} {:>8.3} {:>9}  {}\n",
            r.backend,
            r.scenario,
            r.workers,
            r.ops,
            r.secs,
            r.ops_per_sec(),
            r.p50_ms,
            r.p99_ms,
            r.max_ms,
            r.owner_switches.map_or("-".to_string(), |s| s.to_string()),
            if r.correct() { "yes" } else { "NO" }
        ));
    }
    out
}

pub async fn bench(args: BenchArgs) -> u8 {
    let urls: Vec<String> = if args.backends.is_empty() {
        vec![
            crate::cli::BackendArg {
                backend: std::env::var("FENCELOCK_BACKEND").ok(),
            }
            .url(),
        ]
    } else {
        args.backends.clone()
    };
    let scenarios: &[Scenario] = match args.scenario {
        Scenario::All => &[
            Scenario::Uncontended,
            Scenario::Contended,
            Scenario::Handoff,
        ],
        Scenario::Uncontended => &[Scenario::Uncontended],
        Scenario::Contended => &[Scenario::Contended],
        Scenario::Handoff => &[Scenario::Handoff],
        Scenario::Held => &[Scenario::Held],
    };
    let run_id = uuid::Uuid::new_v4().simple().to_string()[..8].to_string();
    let mut results = Vec::new();
    for url in &urls {
        let locker = match fencelock::connect(url).await {
            Ok(l) => l,
            Err(e) => return exit::report(&e),
        };
        for &s in scenarios {
            let r = if s == Scenario::Held {
                match crate::bench_held::run(url, &args, &run_id).await {
                    Ok(r) => r,
                    Err(e) => return exit::report(&e),
                }
            } else {
                run_one(&locker, url, s, &args, &run_id).await
            };
            if args.json {
                println!("{}", r.to_json());
            }
            results.push(r);
        }
    }
    let mut t = table(&results);
    for r in results.iter().filter(|r| r.scenario == "held") {
        if let Some(x) = &r.extra {
            t.push_str(&format!(
                "{} held: {} locks through {} renewal ticks: {} renew calls per tick ({} per 100 locks), {} ms per tick, {} bytes of RSS per lock ({} after returning freed memory, {} live on the heap), {} lost\n",
                r.backend,
                x["locks"],
                x["renew_ticks"],
                x["renew_calls_per_tick"],
                x["renew_calls_per_100_locks_per_tick"],
                x["renew_ms_per_tick"],
                x["rss_bytes_per_lock"],
                x["rss_trimmed_bytes_per_lock"],
                x["heap_bytes_per_lock"],
                x["lost"]
            ));
        }
    }
    if args.json {
        eprint!("{t}");
    } else {
        print!("{t}");
    }
    if let Some(path) = &args.plot {
        if let Err(e) = crate::plot::draw(path, &results) {
            eprintln!("fencelock: cannot draw {}: {e}", path.display());
            return exit::FAILURE;
        }
        eprintln!("plot written to {}", path.display());
    }
    for r in results.iter().filter(|r| !r.correct()) {
        eprintln!(
            "fencelock: {} {} was not correct: counter {} of {}, errors: {:?}",
            r.backend,
            r.scenario,
            r.final_counter,
            r.expected_counter,
            r.errors.iter().take(3).collect::<Vec<_>>()
        );
    }
    if results.iter().all(RunResult::correct) {
        0
    } else {
        exit::FAILURE
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_use_nearest_rank() {
        let v: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        assert_eq!(percentile_ms(&v, 0.50), 50.0);
        assert_eq!(percentile_ms(&v, 0.99), 99.0);
        assert_eq!(percentile_ms(&[], 0.5), 0.0);
    }
}
