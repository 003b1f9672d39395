//! One buyer process of the demo.

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use fencelock::Locker;
use tokio::io::{AsyncBufReadExt, BufReader};

use super::stock::Stock;
use crate::cli::parse_duration;
use crate::exit;

#[derive(Debug, Args)]
pub struct BuyerArgs {
    /// 1: no lock; 2: with fencelock; 3 and 4: with fencelock and fenced writes.
    #[arg(long)]
    pub act: u8,
    #[arg(long)]
    pub stock_db: PathBuf,
    #[arg(long)]
    pub backend: String,
    #[arg(long)]
    pub key: String,
    #[arg(long)]
    pub name: String,
    #[arg(long, value_parser = parse_duration)]
    pub think: Duration,
    #[arg(long, value_parser = parse_duration, default_value = "10s")]
    pub ttl: Duration,
    /// The holder of act 3 (paused) or 4 (its master fails over): take the
    /// lock once, report, write late.
    #[arg(long)]
    pub victim: bool,
}

/// Runs blocking stock I/O without stalling the runtime's other tasks.
fn io<T>(f: impl FnOnce() -> super::stock::Result<T>) -> Result<T, String> {
    tokio::task::block_in_place(f)
}

pub async fn buyer(args: BuyerArgs) -> u8 {
    match shop(&args).await {
        Ok(bought) => {
            say(format_args!("{} bought {bought}", args.name));
            0
        }
        Err(e) => {
            eprintln!("fencelock demo buyer {}: {e}", args.name);
            exit::FAILURE
        }
    }
}

async fn shop(args: &BuyerArgs) -> Result<u64, String> {
    let stock = Stock::open(&args.stock_db)?;
    if args.act == 1 {
        return shop_without_lock(args, &stock).await;
    }
    let locker = fencelock::connect_within(&args.backend, Some(super::CONNECT_WAIT))
        .await
        .map_err(|e| e.to_string())?;
    if args.victim && args.act == 4 {
        return failed_over_holder(args, &locker, &stock).await;
    }
    if args.victim {
        return paused_holder(args, &locker, &stock).await;
    }
    let mut bought = 0;
    loop {
        let guard = locker
            .lock(&args.key)
            .ttl(args.ttl)
            .acquire()
            .await
            .map_err(|e| e.to_string())?;
        let n = io(|| stock.read())?;
        if n <= 0 {
            guard.release().await.map_err(|e| e.to_string())?;
            return Ok(bought);
        }
        tokio::time::sleep(args.think).await;
        let token = guard.token().map(|t| t.get());
        let applied = match (args.act, token) {
            (3 | 4, Some(t)) => io(|| stock.write_fenced(n - 1, t))?,
            (3 | 4, None) => return Err("this act needs a backend with fencing tokens".into()),
            _ => io(|| stock.write(n - 1, token)).map(|()| true)?,
        };
        if applied {
            io(|| stock.record_sale(&args.name, token))?;
            bought += 1;
        } else {
            say(format_args!(
                "{} write rejected with token {token:?}",
                args.name
            ));
        }
        guard.release().await.map_err(|e| e.to_string())?;
    }
}

async fn shop_without_lock(args: &BuyerArgs, stock: &Stock) -> Result<u64, String> {
    let mut bought = 0;
    loop {
        let n = io(|| stock.read())?;
        if n <= 0 {
            return Ok(bought);
        }
        tokio::time::sleep(args.think).await;
        io(|| stock.write(n - 1, None))?;
        io(|| stock.record_sale(&args.name, None))?;
        bought += 1;
    }
}

/// Kleppmann's story: check the lease, pause (the demo SIGSTOPs us here), then
/// write with what we read before the pause.
async fn paused_holder(args: &BuyerArgs, locker: &Locker, stock: &Stock) -> Result<u64, String> {
    let guard = locker
        .lock(&args.key)
        .ttl(args.ttl)
        .acquire()
        .await
        .map_err(|e| e.to_string())?;
    let token = guard
        .token()
        .ok_or("act 3 needs a backend with fencing tokens")?;
    let n = io(|| stock.read())?;
    if !guard.is_valid() {
        return Err("lease invalid right after the grant".into());
    }
    say(format_args!("holding {token} {n}"));
    // The pause lands in this window.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let applied = io(|| stock.write_fenced(n - 1, token.get()))?;
    say(format_args!(
        "stale-write {}",
        if applied { "accepted" } else { "rejected" }
    ));
    if applied {
        io(|| stock.record_sale(&args.name, Some(token.get())))?;
    }
    drop(guard);
    Ok(u64::from(applied))
}

/// The seeds' failure: granted on a master that fails over before its
/// replicas copied the grant. Reports the grant, says `lost` when the hold
/// is lost, and writes what it read when told to (a line on stdin).
async fn failed_over_holder(
    args: &BuyerArgs,
    locker: &Locker,
    stock: &Stock,
) -> Result<u64, String> {
    let guard = locker
        .lock(&args.key)
        .ttl(args.ttl)
        .acquire()
        .await
        .map_err(|e| e.to_string())?;
    let token = guard
        .token()
        .ok_or("act 4 needs a backend with fencing tokens")?;
    let n = io(|| stock.read())?;
    say(format_args!("holding {token} {n}"));
    let lost = guard.lost();
    let said_lost = tokio::spawn(async move {
        let e = lost.await;
        let at = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        say(format_args!("lost {} {e}", at.as_millis()));
    });
    let mut line = String::new();
    BufReader::new(tokio::io::stdin())
        .read_line(&mut line)
        .await
        .map_err(|e| e.to_string())?;
    let valid = guard.is_valid();
    let applied = io(|| stock.write_fenced(n - 1, token.get()))?;
    say(format_args!(
        "stale-write {} {}",
        if applied { "accepted" } else { "rejected" },
        if valid { "valid" } else { "invalid" }
    ));
    if applied {
        io(|| stock.record_sale(&args.name, Some(token.get())))?;
    }
    // The hold ends at the next renewal at the latest: wait for the line.
    let _ = tokio::time::timeout(args.ttl * 2, said_lost).await;
    drop(guard);
    Ok(u64::from(applied))
}

/// One line to the demo; nothing if it is gone (a closed pipe).
fn say(line: std::fmt::Arguments<'_>) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}").and_then(|()| out.flush());
}
