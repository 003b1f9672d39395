//! `fencelock bench --processes P`: the contended and handoff workloads spread
//! over P OS processes on one key, so that waiters of different processes
//! compete (and cross-process fairness shows in `owner_switches`).
//!
//! Each child (`fencelock bench-worker`, hidden) runs its share of the tasks and
//! prints every hold it saw; the parent merges them, checks the merged history
//! (no overlap, tokens rising) and the shared counter, which lives in a file and
//! is read, incremented and written back under the lock.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use clap::Args;
use fencelock::{Hold, Mode, check_history};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, Command};

use crate::exit;

/// One child process of `fencelock bench --processes`.
#[derive(Debug, Args)]
pub struct WorkerArgs {
    #[arg(long)]
    pub backend: String,
    #[arg(long)]
    pub key: String,
    #[arg(long)]
    pub name: String,
    #[arg(long)]
    pub workers: u32,
    #[arg(long)]
    pub cycles: u64,
    #[arg(long)]
    pub counter: PathBuf,
}

const BENCH_TTL: Duration = Duration::from_secs(30);

/// Reads the counter, adds one and writes it back in place, always 20 digits
/// (zero-padded), so that every write covers the whole number: a stale holder's
/// shorter write can only set it back, never leave old digits behind that lift
/// it (which could hide lost updates). Not truncated and rewritten: on ext4 a
/// file truncated to nothing and written again starts its writeback when closed
/// (`auto_da_alloc`), about 170 µs a cycle on the development machine against
/// 2 µs in place — a cost inside the critical section that measured the file
/// system, not the lock.
fn bump(counter: &Path) -> std::io::Result<()> {
    use std::io::{Read, Seek, SeekFrom, Write};
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(counter)?;
    let mut s = String::new();
    f.read_to_string(&mut s)?;
    let v: u64 = s.trim().parse().unwrap_or(0);
    f.seek(SeekFrom::Start(0))?;
    f.write_all(counter_text(v + 1).as_bytes())
}

/// The counter as `bump` writes it: 20 digits, zero-padded.
fn counter_text(v: u64) -> String {
    format!("{v:020}")
}

/// The child: waits for "go" on stdin, runs its tasks, prints its holds.
pub async fn worker(args: WorkerArgs) -> u8 {
    let locker = match fencelock::connect(&args.backend).await {
        Ok(l) => l,
        Err(e) => return exit::report(&e),
    };
    println!("ready");
    let mut go = String::new();
    if BufReader::new(tokio::io::stdin())
        .read_line(&mut go)
        .await
        .is_err()
    {
        return exit::FAILURE;
    }
    let lines = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for w in 0..args.workers {
        let share = args.cycles / u64::from(args.workers)
            + u64::from(u64::from(w) < args.cycles % u64::from(args.workers));
        let (locker, key, counter, lines) = (
            locker.clone(),
            args.key.clone(),
            args.counter.clone(),
            lines.clone(),
        );
        let holder = format!("{}-{w}", args.name);
        tasks.push(tokio::spawn(async move {
            for _ in 0..share {
                let line = cycle(&locker, &key, &holder, &counter).await;
                lines.lock().unwrap_or_else(|p| p.into_inner()).push(line);
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    let lines = std::mem::take(&mut *lines.lock().unwrap_or_else(|p| p.into_inner()));
    let mut out = lines.join("\n");
    out.push('\n');
    let mut stdout = tokio::io::stdout();
    if stdout.write_all(out.as_bytes()).await.is_err() || stdout.flush().await.is_err() {
        return exit::FAILURE;
    }
    0
}

/// One cycle of a worker: acquire, bump the counter, release; the line it
/// prints for it.
async fn cycle(locker: &fencelock::Locker, key: &str, holder: &str, counter: &Path) -> String {
    let asked = Hold::now_ns();
    match locker.lock(key).ttl(BENCH_TTL).acquire().await {
        Ok(g) => {
            let acquired_ns = Hold::now_ns();
            let bumped = bump(counter);
            tokio::task::yield_now().await;
            let hold = Hold {
                holder: holder.to_string(),
                mode: Mode::Exclusive,
                token: g.token().map(|t| t.get()),
                acquired_ns,
                released_ns: Hold::now_ns(),
            };
            match (bumped, g.release().await) {
                (Ok(()), Ok(())) => format!("hold {asked} {}", hold.to_line()),
                (Err(e), _) => format!("error counter file: {e}"),
                (_, Err(e)) => format!("error {e}"),
            }
        }
        Err(e) => format!("error {e}"),
    }
}

/// What the children report, merged.
pub struct Merged {
    /// (asked, hold) per successful cycle.
    pub holds: Vec<(u128, Hold)>,
    pub errors: Vec<String>,
    pub counter: u64,
}

impl Merged {
    /// Holds in grant order.
    fn sorted(&self) -> Vec<&(u128, Hold)> {
        let mut v: Vec<_> = self.holds.iter().collect();
        v.sort_by_key(|(_, h)| h.acquired_ns);
        v
    }

    /// Acquire waits, or (with `handoff`) the time from each release to the next grant.
    pub fn latencies(&self, handoff: bool) -> Vec<Duration> {
        let sorted = self.sorted();
        if handoff {
            sorted
                .windows(2)
                .map(|w| {
                    Duration::from_nanos(
                        w[1].1.acquired_ns.saturating_sub(w[0].1.released_ns) as u64
                    )
                })
                .collect()
        } else {
            sorted
                .iter()
                .map(|(asked, h)| Duration::from_nanos(h.acquired_ns.saturating_sub(*asked) as u64))
                .collect()
        }
    }

    /// Which worker got each grant, in order (workers numbered by first grant).
    pub fn order(&self) -> Vec<u32> {
        let mut ids = std::collections::HashMap::new();
        self.sorted()
            .iter()
            .map(|(_, h)| {
                let next = ids.len() as u32;
                *ids.entry(h.holder.as_str()).or_insert(next)
            })
            .collect()
    }

    /// Wall time from the first request to the last release.
    pub fn secs(&self) -> f64 {
        let first = self.holds.iter().map(|(a, _)| *a).min().unwrap_or(0);
        let last = self
            .holds
            .iter()
            .map(|(_, h)| h.released_ns)
            .max()
            .unwrap_or(first);
        (last.saturating_sub(first)) as f64 / 1e9
    }
}

/// Runs `workers` tasks in `processes` children of this executable on `key`.
pub async fn run(url: &str, key: &str, workers: u32, cycles: u64, processes: u32) -> Merged {
    let mut merged = Merged {
        holds: Vec::new(),
        errors: Vec::new(),
        counter: 0,
    };
    let dir = match tempfile::tempdir() {
        Ok(d) => d,
        Err(e) => {
            merged.errors.push(format!("temporary directory: {e}"));
            return merged;
        }
    };
    let counter = dir.path().join("counter");
    if let Err(e) = std::fs::write(&counter, "0") {
        merged.errors.push(format!("counter file: {e}"));
        return merged;
    }
    let children = match spawn(url, key, &counter, &shares(workers, cycles, processes)) {
        Ok(c) => c,
        Err(e) => {
            merged.errors.push(e);
            return merged;
        }
    };
    gather(children, &mut merged).await;
    merged.counter = std::fs::read_to_string(&counter)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0);
    let holds: Vec<Hold> = merged.holds.iter().map(|(_, h)| h.clone()).collect();
    if let Err(v) = check_history(&holds) {
        merged
            .errors
            .push(format!("history violated across processes: {v}"));
    }
    merged
}

/// Per process, its workers and its cycles: workers spread evenly, cycles in
/// proportion, the remainder to the first.
fn shares(workers: u32, cycles: u64, processes: u32) -> Vec<(u32, u64)> {
    let workers_of: Vec<u32> = (0..processes)
        .map(|p| workers / processes + u32::from(p < workers % processes))
        .collect();
    let mut cycles_of: Vec<u64> = workers_of
        .iter()
        .map(|w| cycles * u64::from(*w) / u64::from(workers))
        .collect();
    cycles_of[0] += cycles - cycles_of.iter().sum::<u64>();
    workers_of.into_iter().zip(cycles_of).collect()
}

/// Starts one `bench-worker` child of this executable per share.
fn spawn(
    url: &str,
    key: &str,
    counter: &Path,
    shares: &[(u32, u64)],
) -> Result<Vec<Child>, String> {
    let exe = std::env::current_exe().map_err(|e| format!("own executable: {e}"))?;
    let mut children = Vec::new();
    for (p, (w, c)) in shares.iter().enumerate() {
        let child = Command::new(&exe)
            .args([
                "bench-worker",
                "--backend",
                url,
                "--key",
                key,
                "--name",
                &format!("p{p}"),
            ])
            .args(["--workers", &w.to_string(), "--cycles", &c.to_string()])
            .arg("--counter")
            .arg(counter)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot start a bench worker: {e}"))?;
        children.push(child);
    }
    Ok(children)
}

/// Waits until every child is connected, starts them together, and merges
/// what they print into `merged`.
async fn gather(mut children: Vec<Child>, merged: &mut Merged) {
    let mut outs = Vec::new();
    for c in &mut children {
        let Some(out) = c.stdout.take() else { continue };
        let mut lines = BufReader::new(out).lines();
        match lines.next_line().await {
            Ok(Some(l)) if l == "ready" => outs.push(lines),
            other => merged
                .errors
                .push(format!("a bench worker did not start: {other:?}")),
        }
    }
    for c in &mut children {
        if let Some(mut stdin) = c.stdin.take() {
            let _ = stdin.write_all(b"go\n").await;
        }
    }
    for mut lines in outs {
        while let Ok(Some(l)) = lines.next_line().await {
            merged.take_line(&l);
        }
    }
    for mut c in children {
        match c.wait().await {
            Ok(s) if s.success() => {}
            other => merged
                .errors
                .push(format!("a bench worker failed: {other:?}")),
        }
    }
}

impl Merged {
    /// Takes one line a worker printed: a hold, or an error.
    fn take_line(&mut self, l: &str) {
        if let Some(rest) = l.strip_prefix("hold ") {
            let parsed = rest
                .split_once(' ')
                .and_then(|(asked, h)| Some((asked.parse().ok()?, Hold::from_line(h)?)));
            match parsed {
                Some(x) => self.holds.push(x),
                None => self.errors.push(format!("bad worker line {l:?}")),
            }
        } else if let Some(e) = l.strip_prefix("error ") {
            self.errors.push(e.to_string());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{bump, counter_text};

    fn read(counter: &std::path::Path) -> u64 {
        std::fs::read_to_string(counter)
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    }

    #[test]
    fn bump_counts_up_in_place_across_a_new_digit() {
        let dir = tempfile::tempdir().unwrap();
        let counter = dir.path().join("counter");
        std::fs::write(&counter, "0").unwrap();
        for _ in 0..12 {
            bump(&counter).unwrap();
        }
        assert_eq!(read(&counter), 12);
        std::fs::remove_file(&counter).unwrap();
        assert!(
            bump(&counter).is_err(),
            "a missing counter file counted from 0"
        );
    }

    #[test]
    fn a_stale_write_of_a_shorter_number_sets_the_counter_back() {
        let dir = tempfile::tempdir().unwrap();
        let counter = dir.path().join("counter");
        std::fs::write(&counter, "19").unwrap();
        // A holder reads 19 …
        let stale = read(&counter);
        // … 180 cycles run meanwhile (the lock failed) …
        for _ in 0..180 {
            bump(&counter).unwrap();
        }
        assert_eq!(read(&counter), 199);
        // … and writes 20 in place over 199, as `bump` writes: the count
        // drops (a visible loss); it does not become 209.
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .open(&counter)
            .unwrap();
        std::io::Write::write_all(&mut f, counter_text(stale + 1).as_bytes()).unwrap();
        drop(f);
        assert_eq!(read(&counter), 20);
    }
}
