//! The command line: subcommands, flags, and the parsing of durations.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

/// Distributed locks that stay correct when holders pause, servers fail over and
/// networks split: `flock` for a cluster, with fencing tokens.
#[derive(Debug, Parser)]
#[command(name = "fencelock")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run a command while holding a lock (like flock, for a cluster).
    #[command(after_help = RUN_HELP)]
    Run(RunArgs),
    /// The flash sale: buyer processes oversell without a lock, sell exactly the
    /// stock with fencelock, and a paused holder's stale write is fenced off.
    #[command(after_help = DEMO_HELP)]
    Demo(DemoArgs),
    /// Measure acquire/release speed and fairness on one or more backends.
    #[command(after_help = BENCH_HELP)]
    Bench(BenchArgs),
    /// Show who holds a key: holder, mode, holds, token, time left.
    #[command(after_help = STATUS_HELP)]
    Status(StatusArgs),
    /// List the held keys (optionally under a prefix).
    #[command(after_help = LIST_HELP)]
    List(ListArgs),
    /// Torture a backend: client processes under random faults (pauses, kills,
    /// partitions, lost replies, restarts, clock offsets), then check the whole
    /// history for overlaps, token regressions and superseded writes.
    #[command(after_help = TORTURE_HELP)]
    Torture(TortureArgs),
    /// One client process of `fencelock torture`.
    #[command(name = "__torture-client", hide = true)]
    TortureClient(TortureClientArgs),
    /// One buyer of the demo (started by `fencelock demo`).
    #[command(hide = true)]
    DemoBuyer(crate::demo::BuyerArgs),
    /// One worker process of `fencelock bench --processes`.
    #[command(hide = true)]
    BenchWorker(crate::bench_procs::WorkerArgs),
    /// The reaper of a `run`'s process group (started by `fencelock run`).
    #[command(name = "__reap", hide = true)]
    Reap(ReapArgs),
}

/// `fencelock __reap PGID`.
#[derive(Debug, Args)]
pub struct ReapArgs {
    /// The process group to SIGKILL when the pipe on stdin closes.
    pub pgid: i32,
}

/// `--backend`, shared by every subcommand.
#[derive(Debug, Clone, Args)]
pub struct BackendArg {
    /// Backend URL (memory://, sqlite://PATH, …). Default: $FENCELOCK_BACKEND, else
    /// the embedded SQLite file.
    #[arg(long, env = "FENCELOCK_BACKEND", value_name = "URL")]
    pub backend: Option<String>,
}

impl BackendArg {
    /// The URL to connect to.
    pub fn url(&self) -> String {
        self.backend
            .clone()
            .filter(|u| !u.trim().is_empty())
            .unwrap_or_else(|| fencelock::DEFAULT_URL.to_string())
    }
}

#[derive(Debug, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub backend: BackendArg,
    /// The lock's key.
    #[arg(long, value_name = "KEY")]
    pub key: String,
    /// Lease TTL; renewed at ttl/3 while CMD runs [default: the URL's `ttl=`,
    /// else 30s].
    #[arg(long, value_parser = parse_duration, value_name = "DURATION")]
    pub ttl: Option<Duration>,
    /// How long to wait for the lock: a duration, `0s` to try once, or `forever`.
    #[arg(long, default_value = "forever", value_parser = parse_wait, value_name = "DURATION|forever")]
    pub wait: Wait,
    /// Take a shared (read) lock instead of an exclusive one.
    #[arg(long, conflicts_with = "permits")]
    pub shared: bool,
    /// Take one of N permits of a semaphore instead of an exclusive lock.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub permits: Option<u32>,
    /// How long CMD has between SIGTERM and SIGKILL when the lease cannot be
    /// kept [default: the lesser of 5s and ttl/3; at most ttl/3 is used].
    #[arg(long, value_parser = parse_duration, value_name = "DURATION")]
    pub kill_grace: Option<Duration>,
    /// The command and its arguments.
    #[arg(last = true, required = true, value_name = "CMD")]
    pub command: Vec<String>,
}

#[derive(Debug, Args)]
pub struct DemoArgs {
    #[command(flatten)]
    pub backend: BackendArg,
    /// Buyer processes.
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(2..=500))]
    pub processes: u32,
    /// Items in stock.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub stock: u32,
    /// How long a buyer thinks between reading and writing the stock.
    #[arg(long, default_value = "2ms", value_parser = parse_duration, value_name = "DURATION")]
    pub think: Duration,
    /// Lease TTL of the paused holder in act 3 (it is paused for twice as long).
    #[arg(long, default_value = "1s", value_parser = parse_duration, value_name = "DURATION")]
    pub pause_ttl: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Scenario {
    Uncontended,
    Contended,
    Handoff,
    /// --locks keys held on one Locker through several renewal periods (not in `all`).
    Held,
    All,
}

#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Backend URLs to compare (repeat the flag). Default: $FENCELOCK_BACKEND, else
    /// the embedded SQLite file.
    #[arg(long = "backend", value_name = "URL")]
    pub backends: Vec<String>,
    /// Which workload.
    #[arg(long, value_enum, default_value_t = Scenario::All)]
    pub scenario: Scenario,
    /// Concurrent tasks of the contended and handoff scenarios.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub workers: u32,
    /// Spread the contended and handoff workers over this many OS processes
    /// (the counter then lives in a file, and the merged history is checked).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub processes: u32,
    /// Cycles per run (default: 5000 uncontended, 2000 contended, 1000 handoff).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub cycles: Option<u64>,
    /// Keys of the held scenario.
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub locks: u64,
    /// Print one JSON line per run on stdout (the table goes to stderr).
    #[arg(long)]
    pub json: bool,
    /// Draw ops/s and p99 per backend and scenario into an SVG file.
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct TortureArgs {
    /// The backend to torture (its servers are never killed: give --spawn for
    /// server faults).
    #[arg(
        long,
        value_name = "URL",
        conflicts_with = "spawn",
        required_unless_present = "spawn"
    )]
    pub backend: Option<String>,
    /// Start private servers and torture them: redis, redlock (5 instances),
    /// memcached, etcd (3 members), zookeeper (3 servers), postgres-lease,
    /// postgres-advisory, mysql-lease, mysql-get-lock (MariaDB), redis-sentinel
    /// (a master, a replica, 3 Sentinels), redis-sentinel-wait (the same with
    /// wait_replicas=1), redis-cluster (3 primaries with a replica each).
    #[arg(long, value_name = "KIND", value_parser = parse_spawn)]
    pub spawn: Option<fencelock_torture::SpawnKind>,
    /// Client processes.
    #[arg(long, default_value_t = 6, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub clients: u32,
    /// How long faults are injected.
    #[arg(long, default_value = "30s", value_parser = parse_duration, value_name = "DURATION")]
    pub duration: Duration,
    /// Which faults: all, or a list of pause, kill, partition, lost-reply,
    /// latency, clock, restart, restart-empty, leader, minority, majority,
    /// failover.
    #[arg(long, default_value = "all", value_parser = parse_faults, value_name = "LIST")]
    pub faults: FaultList,
    /// The seed of every random choice [default: random, printed].
    #[arg(long)]
    pub seed: Option<u64>,
    /// The usual TTL of a hold (short, so that faults bite); each acquire
    /// draws its own: this one half the time, else from a quarter of it (at
    /// least 0.5s) to four times it.
    #[arg(long, default_value = "2s", value_parser = parse_duration, value_name = "DURATION")]
    pub ttl: Duration,
    /// Negative control: clients write on after their lease was lost.
    #[arg(long)]
    pub ignore_lost: bool,
    /// Write the whole history (events, register writes, faults) to FILE.
    #[arg(long, value_name = "FILE")]
    pub history: Option<PathBuf>,
    /// Print the report as one JSON line on stdout.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct TortureClientArgs {
    #[arg(long)]
    pub backend: String,
    #[arg(long)]
    pub name: String,
    #[arg(long)]
    pub register: std::net::SocketAddr,
    #[arg(long, value_parser = parse_duration)]
    pub ttl: Duration,
    #[arg(long)]
    pub seed: u64,
    #[arg(long)]
    pub prefix: String,
    #[arg(long)]
    pub ignore_lost: bool,
}

fn parse_spawn(s: &str) -> Result<fencelock_torture::SpawnKind, String> {
    fencelock_torture::SpawnKind::parse(s.trim()).ok_or_else(|| {
        let names: Vec<&str> = fencelock_torture::SpawnKind::ALL
            .iter()
            .map(|(n, _)| *n)
            .collect();
        format!("unknown kind {s:?}; known: {}", names.join(", "))
    })
}

/// The faults of `--faults`.
#[derive(Debug, Clone)]
pub struct FaultList(pub Vec<fencelock_torture::FaultKind>);

fn parse_faults(s: &str) -> Result<FaultList, String> {
    fencelock_torture::FaultKind::parse_list(s).map(FaultList)
}

#[derive(Debug, Args)]
pub struct StatusArgs {
    #[command(flatten)]
    pub backend: BackendArg,
    /// The lock's key (optional with --watch: then every held key under --prefix).
    #[arg(required_unless_present = "watch")]
    pub key: Option<String>,
    /// Refresh a table of the held keys every --interval until Ctrl-C.
    #[arg(long)]
    pub watch: bool,
    /// With --watch: only keys that start with this.
    #[arg(long, default_value = "", value_name = "P", requires = "watch")]
    pub prefix: String,
    /// One JSON object (with --watch: one per refresh, a line each) instead of
    /// the table.
    #[arg(long)]
    pub json: bool,
    /// With --watch: how often to refresh.
    #[arg(long, default_value = "1s", value_parser = parse_interval, value_name = "D", requires = "watch")]
    pub interval: Duration,
}

#[derive(Debug, Args)]
pub struct ListArgs {
    #[command(flatten)]
    pub backend: BackendArg,
    /// Only keys that start with this.
    #[arg(long, default_value = "", value_name = "P")]
    pub prefix: String,
}

/// How long `run` waits for the lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    Forever,
    For(Duration),
}

/// A refresh interval: a duration of at least 10 ms.
fn parse_interval(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d < Duration::from_millis(10) {
        return Err("the interval must be at least 10ms".to_string());
    }
    Ok(d)
}

/// A humantime duration: `500ms`, `30s`, `5m`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    /// Longer than any lease or wait is meant to be, short enough that every
    /// deadline computed from it fits the clocks.
    const MAX: Duration = Duration::from_secs(10 * 366 * 24 * 3600);
    let d = humantime::parse_duration(s.trim())
        .map_err(|e| format!("{e}; write a duration such as 500ms, 30s or 5m"))?;
    if d > MAX {
        return Err(format!(
            "{s:?} is too long; at most 10 years (use --wait forever to wait without end)"
        ));
    }
    Ok(d)
}

fn parse_wait(s: &str) -> Result<Wait, String> {
    match s.trim() {
        "forever" | "inf" | "infinite" => Ok(Wait::Forever),
        other => parse_duration(other).map(Wait::For),
    }
}

const RUN_HELP: &str = "\
Examples:
  fencelock run --key nightly -- ./job.sh                 # wait forever, like flock
  fencelock run --key nightly --wait 0s -- ./job.sh       # try once, like flock -n
  fencelock run --backend sqlite:///var/lib/locks.db --key db-migrate --ttl 10s -- make migrate

CMD sees FENCELOCK_TOKEN (the fencing token; empty if the backend has none) and
FENCELOCK_KEY. CMD runs in a process group of its own: SIGINT, SIGTERM, SIGHUP and
SIGQUIT go to that group, and the lock is released only after the whole group has
ended. If the lease cannot be kept, the group gets SIGTERM and then SIGKILL before
the lease could run out; if fencelock itself dies, the group is SIGKILLed.

Exit status: CMD's own; 75 lock not acquired within --wait; 76 lease lost (CMD was
killed); 69 backend unreachable; 64 bad usage.";

const DEMO_HELP: &str = "\
Examples:
  fencelock demo
  fencelock demo --processes 20 --stock 50
  fencelock demo --backend sqlite:///tmp/demo-locks.db

Exit status 0 only if every act that ran with fencelock is correct (nothing
oversold, tokens strictly increasing, the stale write rejected). Act 4 runs on a
Redis Sentinel setup (--backend redis+sentinel://…) and fails it over: use a
setup you may break.";

const BENCH_HELP: &str = "\
Examples:
  fencelock bench --scenario all
  fencelock bench --backend memory:// --backend sqlite:///tmp/b.db --json --plot bench.svg
  fencelock bench --scenario contended --workers 32 --cycles 2000
  fencelock bench --scenario held --locks 10000   # renewal cost and memory of 10,000 held locks
  fencelock bench --backend redis://127.0.0.1:6379 --scenario contended --processes 4 --workers 32

JSON line: {\"system\",\"backend\",\"scenario\",\"workers\",\"ops\",\"secs\",\"ops_per_sec\",
\"p50_ms\",\"p99_ms\",\"max_ms\",\"owner_switches\",\"final_counter\",\"expected_counter\",\"correct\"}.
Latency: uncontended = one acquire+release cycle; contended = acquire wait;
handoff = from a holder's release to the next grant.";

const TORTURE_HELP: &str = "\
Examples:
  fencelock torture --backend redis://127.0.0.1:6379 --clients 8 --duration 60s --seed 42
  fencelock torture --spawn zookeeper --faults leader,pause,partition --duration 30s --json
  fencelock torture --backend memory:// --duration 5s      # a negative control: must fail

With --backend, only the clients are faulted: they are the tool's own processes, and
every connection goes through its fault proxies (the servers are never touched). With
--spawn, the tool starts private servers on free ports and also kills and restarts them.

Exit status: 0 if the history has no violation; 1 if it has (each printed with the seed
that reproduces it); 69 backend unreachable; 64 bad usage.";

const STATUS_HELP: &str = "\
Examples:
  fencelock status nightly
  fencelock status --backend sqlite:///var/lib/locks.db orders/42
  fencelock status --watch --prefix orders/      # a live table until Ctrl-C
  fencelock status --watch --json | jq .         # one object per refresh";

const LIST_HELP: &str = "\
Examples:
  fencelock list
  fencelock list --prefix orders/";
