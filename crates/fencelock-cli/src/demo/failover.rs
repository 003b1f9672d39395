//! Act 4, on a Redis Sentinel setup: the master fails over before its
//! replicas copied a grant. A holder is granted on the master once its
//! replicas are cut off; the Sentinels promote a replica that never saw the
//! grant; the other buyers lock there while the holder still believes it
//! holds the lock; its write carries the older token and the fenced update
//! rejects it.

use std::process::Stdio;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fencelock::backends::redis::drill::Drill;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::ChildStdout;

use super::{Setup, wait_all};

/// The holder's TTL: long enough that its next renewal comes after the others
/// sold out, so that two buyers hold at once.
const HOLDER_TTL: &str = "30s";

/// Whether the act can run on `url`, else why not.
pub fn runs_on(url: &str) -> Result<(), &'static str> {
    if !url.starts_with("redis+sentinel://") {
        return Err("it needs a Redis Sentinel setup (--backend redis+sentinel://…)");
    }
    let waits = url.split_once('?').is_some_and(|(_, q)| {
        q.split('&')
            .any(|o| o.starts_with("wait_replicas=") && o != "wait_replicas=0")
    });
    if waits {
        return Err(
            "with wait_replicas a grant counts only once a replica has it, and this act cuts the replicas off",
        );
    }
    Ok(())
}

/// Returns whether the stale write was accepted, or `None` if the setup
/// cannot stage the failure (said why). The replicas are let copy again
/// however the act ends (also on Ctrl-C).
pub async fn failed_over_holder_act(setup: &Setup<'_>) -> Result<Option<bool>, String> {
    let drill = match Drill::cut(&setup.backend).await {
        Ok(d) => d,
        Err(e) => {
            println!("   skipped: the master cannot be cut off from its replicas: {e}");
            return Ok(None);
        }
    };
    let result = tokio::select! {
        r = with_replicas_cut(setup, &drill) => r,
        why = stopped() => Err(why),
    };
    let restored = drill
        .restore()
        .await
        .map_err(|e| format!("the replicas stay cut off: {e}"));
    let accepted = result?;
    restored?;
    Ok(Some(accepted))
}

async fn with_replicas_cut(setup: &Setup<'_>, drill: &Drill) -> Result<bool, String> {
    println!(
        "   cut the master {} off from its {} replica(s)",
        drill.master(),
        drill.replicas()
    );
    let mut holder = setup
        .buyer(4, "failed-over-holder")
        .arg("--victim")
        .arg("--ttl")
        .arg(HOLDER_TTL)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start the holder: {e}"))?;
    let mut tell = holder.stdin.take().ok_or("no stdin to the holder")?;
    let out = holder.stdout.take().ok_or("no stdout from the holder")?;
    let mut lines = BufReader::new(out).lines();
    let holding = next_line(&mut lines).await?;
    let Some((token, read)) = holding
        .strip_prefix("holding ")
        .and_then(|rest| rest.split_once(' '))
    else {
        return Err(format!("unexpected line from the holder: {holding:?}"));
    };
    println!(
        "   a holder got the lock with token {token} (it read stock {read}); no replica has the grant"
    );
    let new = drill
        .fail_over(Duration::from_secs(60))
        .await
        .map_err(|e| e.to_string())?;
    let failed_over = SystemTime::now();
    println!(
        "   the Sentinels promoted {new}, which never saw the grant; the other buyers lock there"
    );
    wait_all(setup.spawn_buyers(4, setup.args.processes - 1)?).await?;
    tell.write_all(b"write\n")
        .await
        .map_err(|e| format!("cannot tell the holder to write: {e}"))?;
    let mut lost_at = None;
    let (verdict, valid) = loop {
        let line = next_line(&mut lines).await?;
        if let Some(at) = lost_time(&line) {
            lost_at = Some(at);
        } else if let Some(v) = line.strip_prefix("stale-write ") {
            let (verdict, valid) = v.split_once(' ').unwrap_or((v, ""));
            break (verdict.to_string(), valid == "valid");
        }
    };
    if valid {
        println!(
            "   the holder still believed it held the lock after the others sold out: two held at once"
        );
    }
    println!(
        "   its write with token {token}, read before the failover, was {verdict} by the fenced update"
    );
    while lost_at.is_none() {
        lost_at = lost_time(&next_line(&mut lines).await?);
    }
    if let Some(after) = lost_at.and_then(|at| at.duration_since(failed_over).ok()) {
        println!(
            "   it learned it had lost the lock {:.1}s after the failover, at its next renewal",
            after.as_secs_f64()
        );
    }
    let _ = holder.kill().await;
    Ok(verdict == "accepted")
}

/// Resolves when the demo is told to stop (SIGINT, SIGTERM, SIGHUP), so
/// that the replicas are put back first; says which.
async fn stopped() -> String {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut hup)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::hangup()),
    ) else {
        let _ = tokio::signal::ctrl_c().await;
        return "interrupted".into();
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => "interrupted (SIGINT)".into(),
        _ = term.recv() => "stopped (SIGTERM)".into(),
        _ = hup.recv() => "stopped (SIGHUP)".into(),
    }
}

/// When the holder's `lost <unix ms> …` line says it lost the hold.
fn lost_time(line: &str) -> Option<SystemTime> {
    let ms = line
        .strip_prefix("lost ")?
        .split(' ')
        .next()?
        .parse()
        .ok()?;
    Some(UNIX_EPOCH + Duration::from_millis(ms))
}

async fn next_line(lines: &mut Lines<BufReader<ChildStdout>>) -> Result<String, String> {
    tokio::time::timeout(Duration::from_secs(90), lines.next_line())
        .await
        .map_err(|_| "the holder said nothing for 90 s".to_string())?
        .map_err(|e| e.to_string())?
        .ok_or_else(|| "the holder exited early".to_string())
}
