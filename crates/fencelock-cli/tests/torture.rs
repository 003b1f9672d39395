//! `fencelock torture` on real backends. The negative controls must fail —
//! so that a green campaign means something.

use std::process::Command;

fn torture(args: &[&str]) -> (i32, serde_json::Value) {
    let out = Command::new(env!("CARGO_BIN_EXE_fencelock"))
        .arg("torture")
        .args(args)
        .arg("--json")
        .output()
        .expect("run fencelock torture");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let report = serde_json::from_str(stdout.lines().last().unwrap_or(""))
        .unwrap_or_else(|e| panic!("no JSON report ({e}); stdout {stdout:?}; stderr:\n{stderr}"));
    (out.status.code().unwrap_or(-1), report)
}

#[test]
fn memory_backends_of_separate_processes_do_not_exclude_and_the_tool_says_so() {
    let (code, r) = torture(&[
        "--backend",
        "memory://",
        "--faults",
        "pause",
        "--clients",
        "3",
        "--duration",
        "6s",
        "--ttl",
        "1s",
        "--seed",
        "7",
    ]);
    assert_eq!(code, 1, "{r}");
    assert!(r["overlaps"].as_u64() > Some(0), "{r}");
    assert!(r["violations"].as_u64() > Some(0), "{r}");
}

#[test]
fn a_client_that_ignores_lost_has_its_stale_writes_rejected_by_the_register() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("t.db").display());
    let (code, r) = torture(&[
        "--backend",
        &url,
        "--faults",
        "pause",
        "--ignore-lost",
        "--clients",
        "3",
        "--duration",
        "12s",
        "--ttl",
        "1s",
        "--seed",
        "8",
    ]);
    assert!(
        r["stale_writes_rejected"].as_u64() > Some(0),
        "fencing never had to act: {r}"
    );
    assert_eq!(r["superseded_writes_accepted"], 0, "{r}");
    assert_eq!(r["overlaps"], 0, "{r}");
    assert_eq!(code, 0, "{r}");
}

#[test]
fn without_tokens_a_paused_holder_that_ignores_lost_overwrites_its_successor() {
    let (code, r) = torture(&[
        "--backend",
        "memcached://127.0.0.1:11211",
        "--faults",
        "pause",
        "--ignore-lost",
        "--clients",
        "3",
        "--duration",
        "12s",
        "--ttl",
        "1s",
        "--seed",
        "9",
    ]);
    assert_eq!(r["fencing"], false, "{r}");
    assert!(r["superseded_writes_accepted"].as_u64() > Some(0), "{r}");
    assert_eq!(r["overlaps"], 0, "{r}");
    assert_eq!(code, 1, "{r}");
}

#[test]
fn bad_input_is_refused_with_usage_status() {
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_fencelock"))
            .arg("torture")
            .args(args)
            .output()
            .unwrap()
    };
    let out = run(&["--backend", "memory://", "--faults", "pause,gc"]);
    assert_eq!(out.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown fault \"gc\""));
    assert_eq!(run(&["--spawn", "oracle"]).status.code(), Some(64));
    assert_eq!(
        run(&[]).status.code(),
        Some(64),
        "neither --backend nor --spawn"
    );
    let out = run(&["--backend", "redis://127.0.0.1:1", "--duration", "1s"]);
    assert_eq!(
        out.status.code(),
        Some(69),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
