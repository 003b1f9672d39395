//! `fencelock bench --scenario held`: its JSON line carries the renewal and
//! memory figures, and every lock is still held at the end.

use std::process::Command;

#[test]
fn held_locks_are_renewed_and_reported() {
    let out = Command::new(env!("CARGO_BIN_EXE_fencelock"))
        .args(["bench", "--backend", "memory://", "--scenario", "held"])
        .args(["--locks", "200", "--workers", "4", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let line: serde_json::Value =
        serde_json::from_str(String::from_utf8_lossy(&out.stdout).trim()).unwrap();
    assert_eq!(line["scenario"], "held", "{line}");
    assert_eq!(line["ops"], 200, "{line}");
    assert_eq!(
        line["final_counter"], 200,
        "every lock held to the end: {line}"
    );
    assert_eq!(line["lost"], 0, "{line}");
    assert_eq!(line["correct"], true, "{line}");
    // Held through several renewal periods, one batched call per tick.
    assert!(line["renew_ticks"].as_f64().unwrap() >= 2.0, "{line}");
    assert!(
        line["renew_calls_per_tick"].as_f64().unwrap() >= 1.0,
        "{line}"
    );
    assert!(line["rss_bytes_per_lock"].is_u64(), "{line}");
    assert!(line["rss_trimmed_bytes_per_lock"].is_u64(), "{line}");
    // Counted only by a build with the `heap-count` feature.
    assert_eq!(
        line["heap_bytes_per_lock"].is_u64(),
        cfg!(feature = "heap-count"),
        "{line}"
    );
}
