//! `fencelock status --watch`: a live table of the held keys, refreshed until
//! Ctrl-C; with `--json`, one object per refresh for scripts. A refresh that
//! fails (the backend out of reach) is shown and tried again; a backend that
//! cannot list locks ends it.

use std::io::Write;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fencelock::{LockInfo, Locker, Result};

use crate::cli::StatusArgs;
use crate::inspect::unsupported_or;

/// Refreshes until Ctrl-C (status 0) or an error (its status).
pub async fn watch(locker: &Locker, args: &StatusArgs) -> u8 {
    let mut ticker = tokio::time::interval(args.interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let ctrl_c = tokio::signal::ctrl_c();
    tokio::pin!(ctrl_c);
    loop {
        tokio::select! {
            _ = &mut ctrl_c => return 0,
            _ = ticker.tick() => {}
        }
        // Ctrl-C also ends a refresh that hangs on the backend.
        let infos = tokio::select! {
            _ = &mut ctrl_c => return 0,
            r = held(locker, args) => r,
        };
        let infos = match infos {
            Ok(i) => Ok(i),
            Err(e @ fencelock::Error::Unsupported { .. }) => {
                return unsupported_or(&e, locker.backend().name());
            }
            // Shown, and tried again at the next refresh.
            Err(e) => Err(e),
        };
        let text = match (&infos, args.json) {
            (Ok(infos), true) => json(infos).to_string() + "\n",
            (Err(e), true) => {
                serde_json::json!({ "at_ms": unix_ms() as u64, "error": e.to_string() }).to_string()
                    + "\n"
            }
            (Ok(infos), false) => {
                let width = console::Term::stdout().size().1 as usize;
                table(locker, args, infos, width.max(40))
            }
            (Err(e), false) => format!("\x1b[H\x1b[2Jfencelock status: {e} (retrying)\n"),
        };
        let mut out = std::io::stdout().lock();
        if out
            .write_all(text.as_bytes())
            .and_then(|()| out.flush())
            .is_err()
        {
            // The reader is gone (a closed pipe): it has seen enough.
            return 0;
        }
    }
}

/// The held locks to show: `--prefix`'s, or the one key given.
async fn held(locker: &Locker, args: &StatusArgs) -> Result<Vec<LockInfo>> {
    match &args.key {
        Some(k) => Ok(locker
            .inspect(k)
            .await?
            .filter(|i| !i.holders.is_empty())
            .into_iter()
            .collect()),
        None => locker.list(&args.prefix).await,
    }
}

fn unix_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis())
}

/// `{"at_ms": …, "locks": [{"key", "last_token", "holders": [{"owner",
/// "mode", "holds", "token", "expires_in_ms"}]}]}`.
pub(crate) fn json(infos: &[LockInfo]) -> serde_json::Value {
    let locks: Vec<serde_json::Value> = infos
        .iter()
        .map(|i| {
            let holders: Vec<serde_json::Value> = i
                .holders
                .iter()
                .map(|h| {
                    serde_json::json!({
                        "owner": h.owner,
                        "mode": h.mode.to_string(),
                        "holds": h.holds,
                        "token": h.token.map(|t| t.get()),
                        "expires_in_ms": h.expires_in.map(|d| d.as_millis() as u64),
                    })
                })
                .collect();
            serde_json::json!({
                "key": i.key,
                "last_token": i.last_token.map(|t| t.get()),
                "holders": holders,
            })
        })
        .collect();
    serde_json::json!({ "at_ms": unix_ms() as u64, "locks": locks })
}

/// The screen: cleared, a title line, then a row per holder, cut to `width`.
fn table(locker: &Locker, args: &StatusArgs, infos: &[LockInfo], width: usize) -> String {
    let holders: usize = infos.iter().map(|i| i.holders.len()).sum();
    let scope = match (&args.key, args.prefix.as_str()) {
        (Some(k), _) => format!("key {k:?}"),
        (None, "") => "every key".to_string(),
        (None, p) => format!("keys under {p:?}"),
    };
    let mut lines = vec![
        format!(
            "fencelock status — {} — {scope}: {} held, {holders} holder{} — every {} (Ctrl-C to quit)",
            locker.backend().address(),
            infos.len(),
            if holders == 1 { "" } else { "s" },
            humantime::format_duration(args.interval),
        ),
        String::new(),
        row(&["key", "mode", "holds", "time left", "token", "holder"]),
    ];
    for i in infos {
        for h in &i.holders {
            lines.push(row(&[
                &i.key,
                &h.mode.to_string(),
                &h.holds.to_string(),
                &h.expires_in.map_or("-".to_string(), seconds),
                &h.token.map_or("-".to_string(), |t| t.to_string()),
                &h.owner,
            ]));
        }
    }
    if infos.is_empty() {
        lines.push("(nothing held)".to_string());
    }
    // Home, clear the screen, then the lines, each cut to the width.
    let mut out = String::from("\x1b[H\x1b[2J");
    for l in lines {
        out.extend(l.chars().take(width));
        out.push('\n');
    }
    out
}

fn seconds(d: Duration) -> String {
    format!("{:.1}s", d.as_secs_f64())
}

/// One row; the holder (the longest cell, an id) comes last, so that a
/// narrow terminal cuts it rather than the rest.
fn row(cells: &[&str]) -> String {
    format!(
        "{:<24} {:<10} {:>5} {:>9} {:>18}  {}",
        cells[0], cells[1], cells[2], cells[3], cells[4], cells[5]
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_names_every_field() {
        let info = LockInfo::new(
            "k",
            vec![fencelock::HolderInfo::new(
                "me",
                fencelock::Mode::Exclusive,
                2,
                Some(fencelock::FencingToken::new(7)),
                Some(Duration::from_millis(1500)),
            )],
            Some(fencelock::FencingToken::new(7)),
        );
        let v = json(&[info]);
        assert_eq!(v["locks"][0]["key"], "k");
        assert_eq!(v["locks"][0]["last_token"], 7);
        let h = &v["locks"][0]["holders"][0];
        assert_eq!(
            (h["owner"].as_str(), h["holds"].as_u64()),
            (Some("me"), Some(2))
        );
        assert_eq!(h["expires_in_ms"], 1500);
        assert!(v["at_ms"].as_u64().unwrap() > 0);
    }
}
