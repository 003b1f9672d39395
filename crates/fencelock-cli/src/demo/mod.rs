//! `fencelock demo`: the flash sale of the classic articles, with real processes.
//!
//! Act 1: buyers read the stock, think, write stock − 1, with no lock → oversold.
//! Act 2: the same under fencelock → exactly the stock sold, tokens increasing.
//! Act 3: a holder is SIGSTOPped past its TTL between checking its lease and
//! writing; the others sell out; on SIGCONT its stale write carries an old token
//! and the fenced update rejects it.
//! Act 4 (Redis Sentinel only): the master fails over before its replicas
//! copied a grant; two buyers hold at once and the stale one's write is
//! fenced off.

mod buyer;
#[cfg(feature = "redis")]
mod failover;
mod stock;

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

pub use buyer::{BuyerArgs, buyer};
use stock::{Stock, Tally};

use crate::cli::DemoArgs;
use crate::exit;

/// How long the demo and its buyers wait for a backend that does not answer
/// yet (a server starting, a Sentinel service between masters).
const CONNECT_WAIT: Duration = Duration::from_secs(30);

/// One row of the summary table.
struct Act {
    name: &'static str,
    tally: Tally,
    stock: u32,
    stale_write: Option<bool>,
    secs: f64,
    /// Whether the act must be correct for the demo to pass.
    judged: bool,
    /// Whether the backend hands out tokens (else they are not checked).
    fencing: bool,
}

impl Act {
    fn oversold(&self) -> u64 {
        self.tally.sold.saturating_sub(u64::from(self.stock))
    }

    fn correct(&self) -> bool {
        self.tally.sold == u64::from(self.stock)
            && self.tally.left == 0
            && (!self.fencing || self.tally.tokens_increase())
            && self.stale_write != Some(true)
    }

    fn verdict(&self) -> &'static str {
        match (self.judged, self.correct()) {
            (true, true) => "correct",
            (true, false) => "WRONG",
            (false, _) if self.oversold() > 0 => "oversold, as expected without a lock",
            (false, _) => "lucky: no oversell this time",
        }
    }
}

struct Setup<'a> {
    exe: std::path::PathBuf,
    stock_db: &'a Path,
    backend: String,
    key: String,
    args: &'a DemoArgs,
}

impl Setup<'_> {
    fn buyer(&self, act: u8, name: &str) -> Command {
        let mut cmd = Command::new(&self.exe);
        cmd.arg("demo-buyer")
            .arg("--act")
            .arg(act.to_string())
            .arg("--stock-db")
            .arg(self.stock_db)
            .arg("--backend")
            .arg(&self.backend)
            .arg("--key")
            .arg(&self.key)
            .arg("--name")
            .arg(name)
            .arg("--think")
            .arg(humantime::format_duration(self.args.think).to_string())
            .env("FENCELOCK_LOG", "error")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .kill_on_drop(true);
        cmd
    }

    fn spawn_buyers(&self, act: u8, count: u32) -> Result<Vec<Child>, String> {
        (0..count)
            .map(|i| {
                self.buyer(act, &format!("buyer-{i}"))
                    .spawn()
                    .map_err(|e| format!("cannot start a buyer process: {e}"))
            })
            .collect()
    }
}

async fn wait_all(children: Vec<Child>) -> Result<(), String> {
    for mut c in children {
        let status = c.wait().await.map_err(|e| e.to_string())?;
        if !status.success() {
            return Err(format!("a buyer process failed ({status})"));
        }
    }
    Ok(())
}

fn signal(child: &Child, sig: Signal) -> Result<(), String> {
    let pid = child.id().ok_or("the paused holder already exited")?;
    kill(Pid::from_raw(pid as i32), sig)
        .map_err(|e| format!("cannot send {sig} to the paused holder: {e}"))
}

/// Runs act `number`; `None` if it could not start (it said why).
async fn act(
    setup: &Setup<'_>,
    stock: &Stock,
    number: u8,
    fencing: bool,
) -> Result<Option<Act>, String> {
    let args = setup.args;
    stock.reset(args.stock)?;
    let start = Instant::now();
    let stale_write = match number {
        1 | 2 => {
            wait_all(setup.spawn_buyers(number, args.processes)?).await?;
            None
        }
        3 => Some(paused_holder_act(setup).await?),
        #[cfg(feature = "redis")]
        _ => match failover::failed_over_holder_act(setup).await? {
            Some(accepted) => Some(accepted),
            None => return Ok(None),
        },
        #[cfg(not(feature = "redis"))]
        _ => return Err("act 4 needs the redis feature".into()),
    };
    Ok(Some(Act {
        name: match number {
            1 => "1  no lock",
            2 => "2  fencelock",
            3 => "3  paused holder, fenced write",
            _ => "4  failover, fenced write",
        },
        tally: stock.tally()?,
        stock: args.stock,
        stale_write,
        secs: start.elapsed().as_secs_f64(),
        judged: number > 1,
        fencing,
    }))
}

/// Whether act 4 runs on `url`, else why not.
#[cfg(feature = "redis")]
fn failover_act(url: &str) -> Result<(), &'static str> {
    failover::runs_on(url)
}

#[cfg(not(feature = "redis"))]
fn failover_act(_url: &str) -> Result<(), &'static str> {
    Err("this build has no Redis")
}

/// Act 3; returns whether the stale write was accepted.
async fn paused_holder_act(setup: &Setup<'_>) -> Result<bool, String> {
    let args = setup.args;
    let mut victim = setup
        .buyer(3, "paused-holder")
        .arg("--victim")
        .arg("--ttl")
        .arg(humantime::format_duration(args.pause_ttl).to_string())
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start the paused holder: {e}"))?;
    let out = victim
        .stdout
        .take()
        .ok_or("no stdout from the paused holder")?;
    let mut lines = BufReader::new(out).lines();
    let next_line = async |lines: &mut tokio::io::Lines<BufReader<tokio::process::ChildStdout>>| {
        tokio::time::timeout(Duration::from_secs(60), lines.next_line())
            .await
            .map_err(|_| "the paused holder said nothing for 60 s".to_string())?
            .map_err(|e| e.to_string())?
            .ok_or_else(|| "the paused holder exited early".to_string())
    };
    let holding = next_line(&mut lines).await?;
    let Some((token, read)) = holding
        .strip_prefix("holding ")
        .and_then(|rest| rest.split_once(' '))
    else {
        return Err(format!(
            "unexpected line from the paused holder: {holding:?}"
        ));
    };
    signal(&victim, Signal::SIGSTOP)?;
    let paused_at = Instant::now();
    println!(
        "   paused the holder (token {token}; it read stock {read}) with SIGSTOP; the other buyers wait for its TTL"
    );
    wait_all(setup.spawn_buyers(3, args.processes - 1)?).await?;
    let min_pause = args.pause_ttl * 2;
    if let Some(left) = min_pause.checked_sub(paused_at.elapsed()) {
        tokio::time::sleep(left).await;
    }
    println!(
        "   resumed it with SIGCONT after {:.1}s; it writes what it read before the pause",
        paused_at.elapsed().as_secs_f64()
    );
    signal(&victim, Signal::SIGCONT)?;
    let verdict = loop {
        let line = next_line(&mut lines).await?;
        if let Some(v) = line.strip_prefix("stale-write ") {
            break v.to_string();
        }
    };
    let _ = victim.kill().await;
    Ok(verdict == "accepted")
}

fn print_table(acts: &[Act]) {
    if acts.is_empty() {
        return;
    }
    println!();
    println!(
        "{:<32} {:>5} {:>6} {:>9} {:>11} {:>12}  result",
        "act", "sold", "stock", "oversold", "tokens", "stale write"
    );
    for a in acts {
        let tokens = if a.tally.tokens.iter().all(Option::is_none) {
            "-"
        } else if a.tally.tokens_increase() {
            "increasing"
        } else {
            "NOT increasing"
        };
        let stale = match a.stale_write {
            None => "-",
            Some(false) => "rejected",
            Some(true) => "ACCEPTED",
        };
        println!(
            "{:<32} {:>5} {:>6} {:>9} {:>11} {:>12}  {} ({:.1}s)",
            a.name,
            a.tally.sold,
            a.stock,
            a.oversold(),
            tokens,
            stale,
            a.verdict(),
            a.secs
        );
    }
}

pub async fn demo(args: DemoArgs) -> u8 {
    let url = args.backend.url();
    let locker = match fencelock::connect_within(&url, Some(CONNECT_WAIT)).await {
        Ok(l) => l,
        Err(e) => return exit::report(&e),
    };
    let caps = locker.capabilities();
    if !caps.cross_process {
        eprintln!(
            "fencelock: the demo's buyers are separate processes, and the {} backend does not share locks between processes; use sqlite:// or a server backend",
            locker.backend().name()
        );
        return exit::USAGE;
    }
    let address = fencelock::backend::redact_url(&locker.backend().address());
    drop(locker);
    let dir = match tempfile::tempdir() {
        Ok(d) => d,
        Err(e) => {
            eprintln!("fencelock: cannot create a temporary directory: {e}");
            return exit::FAILURE;
        }
    };
    let stock_db = dir.path().join("stock.db");
    let exe = match std::env::current_exe() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("fencelock: cannot find my own executable: {e}");
            return exit::FAILURE;
        }
    };
    let run_id = uuid::Uuid::new_v4().simple().to_string();
    let setup = Setup {
        exe,
        stock_db: &stock_db,
        backend: url,
        key: format!("demo/flash-sale/{}", &run_id[..8]),
        args: &args,
    };
    println!(
        "fencelock demo: a flash sale of {} items to {} buyer processes; lock backend {address}",
        args.stock, args.processes
    );
    let stock = match Stock::open(&stock_db) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("fencelock: {e}");
            return exit::FAILURE;
        }
    };
    let failover = failover_act(&setup.backend);
    if failover.is_ok() {
        println!(
            "act 4 fails over the Sentinel service: writes its master takes during the act are lost; use a setup you may break"
        );
    }
    let mut acts = Vec::new();
    for n in 1..=4u8 {
        if n >= 3 && !caps.fencing {
            println!("act {n} skipped: the {address} backend gives no fencing tokens");
            continue;
        }
        if n == 4
            && let Err(why) = failover
        {
            if setup.backend.starts_with("redis+sentinel://") {
                println!("act 4 skipped: {why}");
            }
            continue;
        }
        println!("act {n}…");
        match act(&setup, &stock, n, caps.fencing).await {
            Ok(Some(a)) => acts.push(a),
            Ok(None) => {}
            Err(e) => {
                print_table(&acts);
                eprintln!("fencelock: act {n} failed: {e}");
                return exit::FAILURE;
            }
        }
    }
    print_table(&acts);
    let ok = acts.iter().filter(|a| a.judged).all(Act::correct);
    println!();
    if let Some(a) = acts.iter().find(|a| !a.judged && a.oversold() > 0) {
        println!(
            "act 1 sold {} of a stock of {}: buyers read the same stock at once and each wrote back what it read minus one, so the decrements of sales made between another buyer's read and write were lost (lost updates) and the stock ran out far too late.",
            a.tally.sold, a.stock
        );
    }
    if ok && caps.fencing {
        println!(
            "with fencelock nothing was oversold, tokens rose with every sale, and the paused holder's stale write was fenced off."
        );
        if acts.len() == 4 {
            println!(
                "after the failover the new master granted the lock again (asynchronous replication lost the first grant); the older token kept the first holder's write out."
            );
        }
        0
    } else if ok {
        println!(
            "with fencelock nothing was oversold; without fencing tokens a holder paused past its TTL could not have been fenced off, so act 3 did not run."
        );
        0
    } else {
        println!(
            "WRONG: an act that uses fencelock oversold, reordered tokens or accepted a stale write."
        );
        exit::FAILURE
    }
}
