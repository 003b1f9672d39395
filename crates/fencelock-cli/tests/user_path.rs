//! The user's path: `fencelock run` as a new user runs it, on every backend
//! configuration `scripts/test.sh` starts — the default TTL, a job that outlives
//! several renewals, a long TTL, the shared and semaphore modes, a waiter
//! stopped with Ctrl-C, `status` and `list`. Configurations run in parallel;
//! a test fails naming every configuration that broke.

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use fencelock_testkit::{Signal, send_signal};

const BIN: &str = env!("CARGO_BIN_EXE_fencelock");

/// One backend configuration of `scripts/services.sh`.
struct Config {
    name: &'static str,
    url: String,
    shared: bool,
    permits: bool,
}

fn configs(dir: &Path) -> Vec<Config> {
    let c = |name, url: &str, shared, permits| Config {
        name,
        url: url.to_string(),
        shared,
        permits,
    };
    let sqlite = format!("sqlite://{}", dir.join("locks.db").display());
    vec![
        c("sqlite", &sqlite, true, true),
        c("redis", "redis://127.0.0.1:6379", true, true),
        c(
            "redis cluster",
            "redis+cluster://127.0.0.1:7101,127.0.0.1:7102,127.0.0.1:7103",
            true,
            true,
        ),
        c(
            "redis sentinel",
            "redis+sentinel://127.0.0.1:7211,127.0.0.1:7212,127.0.0.1:7213/fencelock",
            true,
            true,
        ),
        c(
            "redlock",
            "redlock://127.0.0.1:7001,127.0.0.1:7002,127.0.0.1:7003",
            true,
            false,
        ),
        c("zookeeper", "zk://127.0.0.1:2181", true, true),
        c(
            "zookeeper ensemble",
            "zk://127.0.0.1:2281,127.0.0.1:2282,127.0.0.1:2283",
            true,
            true,
        ),
        c("etcd", "etcd://127.0.0.1:2379", true, true),
        c(
            "etcd cluster",
            "etcd://127.0.0.1:2479,127.0.0.1:2579,127.0.0.1:2679",
            true,
            true,
        ),
        c(
            "postgres lease",
            "postgres://postgres:postgres@127.0.0.1:5432/test",
            true,
            true,
        ),
        c(
            "postgres advisory",
            "postgres://postgres:postgres@127.0.0.1:5432/test?mode=advisory",
            true,
            true,
        ),
        c(
            "mysql lease",
            "mysql://root@127.0.0.1:3306/test",
            true,
            true,
        ),
        c(
            "mysql get_lock",
            "mysql://root@127.0.0.1:3306/test?mode=get_lock",
            false,
            true,
        ),
        c("memcached", "memcached://127.0.0.1:11211", false, false),
    ]
}

/// A key of its own for each test, configuration and run.
fn key(test: &str, config: &Config) -> String {
    let nonce = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    format!(
        "user-path-{test}-{}-{}-{nonce}",
        config.name.replace(' ', "-"),
        std::process::id()
    )
}

/// Runs `check` for every configuration at once; fails naming each one whose
/// check failed, with its reason.
fn each(check: impl Fn(&Config, &Path) -> Result<(), String> + Sync) {
    let dir = tempfile::tempdir().unwrap();
    let configs = configs(dir.path());
    let failures: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = configs
            .iter()
            .map(|c| {
                let work = dir.path().join(c.name.replace(' ', "-"));
                std::fs::create_dir_all(&work).unwrap();
                let check = &check;
                s.spawn(move || check(c, &work))
            })
            .collect();
        configs
            .iter()
            .zip(handles)
            .filter_map(|(c, h)| match h.join() {
                Ok(Ok(())) => None,
                Ok(Err(why)) => Some(format!("{}: {why}", c.name)),
                Err(_) => Some(format!("{}: the check panicked", c.name)),
            })
            .collect()
    });
    assert!(
        failures.is_empty(),
        "{} of {} configurations failed:\n{}",
        failures.len(),
        configs.len(),
        failures.join("\n")
    );
}

fn fencelock(config: &Config, args: &[&str]) -> Command {
    let mut c = Command::new(BIN);
    c.args(args)
        .env("FENCELOCK_BACKEND", &config.url)
        .env_remove("FENCELOCK_LOG")
        .stdin(Stdio::null());
    c
}

fn output(config: &Config, args: &[&str]) -> Result<Output, String> {
    fencelock(config, args)
        .output()
        .map_err(|e| format!("cannot start fencelock: {e}"))
}

fn spawn(config: &Config, args: &[&str]) -> Result<Child, String> {
    fencelock(config, args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start fencelock: {e}"))
}

/// Waits for `child` to exit within `limit` (else kills it); its status and stderr.
fn finish(mut child: Child, limit: Duration) -> Result<(i32, String), String> {
    let start = Instant::now();
    while child.try_wait().map_err(|e| e.to_string())?.is_none() {
        if start.elapsed() > limit {
            let _ = child.kill();
            let out = child.wait_with_output().map_err(|e| e.to_string())?;
            return Err(format!(
                "still running after {limit:?}; stderr: {:?}",
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().map_err(|e| e.to_string())?;
    Ok((
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

/// Waits until `path` exists.
fn wait_for(path: &Path, limit: Duration) -> Result<(), String> {
    let start = Instant::now();
    while !path.exists() {
        if start.elapsed() > limit {
            return Err(format!(
                "{} did not appear within {limit:?}",
                path.display()
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// Writes its stop file when dropped, so that a check that fails early
/// leaves no holder running.
struct Ends<'a>(&'a Path);

impl Drop for Ends<'_> {
    fn drop(&mut self) {
        let _ = std::fs::write(self.0, "");
    }
}

/// A holder's command: writes `started`, then runs until `stop` exists.
fn hold_until(started: &Path, stop: &Path) -> String {
    format!(
        "echo $FENCELOCK_TOKEN > {}; while [ ! -e {} ]; do sleep 0.1; done",
        started.display(),
        stop.display()
    )
}

fn expect(code: i32, stderr: &str, what: &str) -> Result<(), String> {
    if code != 0 || !stderr.is_empty() {
        return Err(format!("{what}: exit {code}, stderr {stderr:?}"));
    }
    Ok(())
}

/// The default TTL, nothing but `--key`: a job of 32 s (three renewal periods
/// of the default TTL, more of a shorter effective one) runs to its end, and
/// fencelock prints nothing.
#[test]
fn a_job_longer_than_the_renewal_period_runs_to_its_end_with_the_default_ttl() {
    each(|c, work| {
        let done = work.join("done");
        let job = format!("sleep 32; echo done > {}", done.display());
        let k = key("default", c);
        let child = spawn(c, &["run", "--key", &k, "--", "sh", "-c", &job])?;
        let (code, stderr) = finish(child, Duration::from_secs(120))?;
        expect(code, &stderr, "run")?;
        if !done.exists() {
            return Err("the job did not complete".into());
        }
        Ok(())
    });
}

/// Holders with a TTL of minutes, in each mode the backend has (two at once
/// where the mode shares): `status --json`, `status` and `list` (twice in a
/// row) show each holder with its owner, mode and token, and once they end
/// the key is free at once.
#[test]
fn long_ttl_holds_in_every_mode_show_in_status_and_free_the_key_when_done() {
    each(|c, work| {
        let mut modes: Vec<(&str, Vec<&str>, &str)> = vec![("exclusive", vec![], "exclusive")];
        if c.shared {
            modes.push(("shared", vec!["--shared"], "shared"));
        }
        if c.permits {
            modes.push(("semaphore", vec!["--permits", "3"], "semaphore:3"));
        }
        for (mode, flags, shown) in modes {
            let k = key(mode, c);
            let stop = work.join(format!("{mode}-stop"));
            let _ends = Ends(&stop);
            let count = if mode == "exclusive" { 1 } else { 2 };
            let mut holders = Vec::new();
            for n in 0..count {
                let started = work.join(format!("{mode}-started-{n}"));
                let script = hold_until(&started, &stop);
                let mut args = vec!["run", "--ttl", "10m", "--wait", "30s", "--key", &k];
                args.extend(&flags);
                args.extend(["--", "sh", "-c", &script]);
                holders.push(spawn(c, &args)?);
                wait_for(&started, Duration::from_secs(30))?;
            }
            let o = output(c, &["status", "--json", &k])?;
            let text = String::from_utf8_lossy(&o.stdout);
            let v: serde_json::Value = serde_json::from_str(text.trim()).map_err(|e| {
                format!(
                    "{mode}: status --json printed {text:?} ({e}); stderr {:?}",
                    String::from_utf8_lossy(&o.stderr)
                )
            })?;
            let shown_holders = v["locks"][0]["holders"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            if v["locks"][0]["key"] != k.as_str() || shown_holders.len() != count {
                return Err(format!("{mode}: {count} holders, status --json shows {v}"));
            }
            for h in &shown_holders {
                let owner = h["owner"].as_str().unwrap_or("");
                if h["mode"] != shown
                    || !owner.contains(':')
                    || (c.name != "memcached" && h["token"].is_null())
                {
                    return Err(format!(
                        "{mode}: status --json shows the holder {h} (mode {shown}, an owner id and a token expected)"
                    ));
                }
            }
            let status = output(c, &["status", &k])?;
            let text = String::from_utf8_lossy(&status.stdout);
            if status.status.code() != Some(0) || !text.contains("held") || !text.contains(shown) {
                return Err(format!("{mode}: status shows {text:?}"));
            }
            for round in 0..2 {
                let list = output(c, &["list", "--prefix", &k])?;
                let text = String::from_utf8_lossy(&list.stdout);
                if list.status.code() != Some(0) || !text.contains(&k) {
                    return Err(format!("{mode}: list (call {}) shows {text:?}", round + 1));
                }
            }
            std::fs::write(&stop, "").map_err(|e| e.to_string())?;
            for h in holders {
                let (code, stderr) = finish(h, Duration::from_secs(60))?;
                expect(code, &stderr, &format!("{mode}: a holder"))?;
            }
            let o = output(c, &["run", "--key", &k, "--wait", "0s", "--", "true"])?;
            expect(
                o.status.code().unwrap_or(-1),
                &String::from_utf8_lossy(&o.stderr),
                &format!("{mode}: the next acquire once the holders ended"),
            )?;
        }
        Ok(())
    });
}

/// A waiter stopped with Ctrl-C (and one stopped with SIGTERM, as a service
/// stop sends) leaves nothing behind: once the holder ends, the next acquire
/// gets the key at once, although the waiters asked for a TTL of minutes.
#[test]
fn a_waiter_stopped_by_a_signal_leaves_nothing_behind() {
    each(|c, work| {
        for (name, sig, code) in [("int", Signal::SIGINT, 130), ("term", Signal::SIGTERM, 143)] {
            let k = key(name, c);
            let started = work.join(format!("{name}-started"));
            let stop = work.join(format!("{name}-stop"));
            let _ends = Ends(&stop);
            let script = hold_until(&started, &stop);
            let holder = spawn(
                c,
                &[
                    "run", "--ttl", "10m", "--key", &k, "--", "sh", "-c", &script,
                ],
            )?;
            wait_for(&started, Duration::from_secs(30))?;
            let waiter = spawn(c, &["run", "--ttl", "10m", "--key", &k, "--", "true"])?;
            // Time to stand in whatever line the backend keeps.
            std::thread::sleep(Duration::from_secs(3));
            send_signal(waiter.id(), sig).map_err(|e| e.to_string())?;
            let (got, stderr) = finish(waiter, Duration::from_secs(30))?;
            if got != code {
                return Err(format!(
                    "SIG{name}: the waiter exited {got}, not {code}; stderr {stderr:?}"
                ));
            }
            std::fs::write(&stop, "").map_err(|e| e.to_string())?;
            let (got, stderr) = finish(holder, Duration::from_secs(60))?;
            expect(got, &stderr, "the holder")?;
            let o = output(c, &["run", "--key", &k, "--wait", "3s", "--", "true"])?;
            expect(
                o.status.code().unwrap_or(-1),
                &String::from_utf8_lossy(&o.stderr),
                &format!("SIG{name}: the next acquire after the waiter left and the holder ended"),
            )?;
        }
        Ok(())
    });
}

/// A `ttl=` in the URL is the TTL of a `run` without `--ttl`.
#[test]
fn the_urls_ttl_applies_unless_ttl_is_given() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = configs(dir.path())
        .into_iter()
        .find(|c| c.name == "redis")
        .unwrap();
    c.url.push_str("?ttl=5m");
    let k = key("url-ttl", &c);
    let started = dir.path().join("started");
    let stop = dir.path().join("stop");
    let _ends = Ends(&stop);
    let script = hold_until(&started, &stop);
    let holder = spawn(&c, &["run", "--key", &k, "--", "sh", "-c", &script]).unwrap();
    wait_for(&started, Duration::from_secs(30)).unwrap();
    let o = output(&c, &["status", "--json", &k]).unwrap();
    std::fs::write(&stop, "").unwrap();
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let left = v["locks"][0]["holders"][0]["expires_in_ms"].as_u64();
    assert!(
        left.is_some_and(|ms| ms > 60_000),
        "a hold of ttl=5m has {left:?} ms left: {v}"
    );
    let (code, stderr) = finish(holder, Duration::from_secs(60)).unwrap();
    expect(code, &stderr, "the holder").unwrap();
}

/// Every valid key works on every backend: one outside the Basic
/// Multilingual Plane too.
#[test]
fn a_key_with_an_emoji_works_everywhere() {
    each(|c, _| {
        let k = format!("report-🔒-{}", key("emoji", c));
        let o = output(c, &["run", "--key", &k, "--wait", "10s", "--", "true"])?;
        expect(
            o.status.code().unwrap_or(-1),
            &String::from_utf8_lossy(&o.stderr),
            "run",
        )
    });
}

/// `url` with every `127.0.0.1:PORT` in it replaced by a fault proxy's
/// address in front of that port; the proxies run on `rt`.
fn proxied(
    rt: &tokio::runtime::Runtime,
    url: &str,
) -> Result<(String, Vec<fencelock_testkit::FaultProxy>), String> {
    let mut out = url.to_string();
    let mut proxies = Vec::new();
    for part in url.split(['/', ',', '@', '?']) {
        let Some(port) = part.strip_prefix("127.0.0.1:") else {
            continue;
        };
        let port: u16 = port.parse().map_err(|_| format!("bad port in {url}"))?;
        let proxy = rt
            .block_on(fencelock_testkit::FaultProxy::start(
                ([127, 0, 0, 1], port).into(),
            ))
            .map_err(|e| format!("proxy: {e}"))?;
        out = out.replace(
            &format!("127.0.0.1:{port}"),
            &format!("127.0.0.1:{}", proxy.addr().port()),
        );
        proxies.push(proxy);
    }
    Ok((out, proxies))
}

/// The server stalls (a proxy that forwards nothing: a frozen server, a
/// silent link), once while `run --wait 3s` waits and once before it
/// connects: either way it returns within seconds of its wait, with 69 or
/// 75, not after a driver's timeouts or never.
#[test]
fn a_stalled_server_cannot_hold_run_past_its_wait() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    each(|c, work| {
        if c.name == "sqlite" {
            return Ok(()); // no server
        }
        let (url, proxies) = proxied(&rt, &c.url)?;
        let via = Config {
            name: c.name,
            url,
            shared: c.shared,
            permits: c.permits,
        };
        let bound = Duration::from_secs(15);
        let ended = |child: Child, start: Instant, what: &str| -> Result<(), String> {
            let (code, stderr) = finish(child, Duration::from_secs(60))?;
            let took = start.elapsed();
            if ![69, 75].contains(&code) || took > bound {
                return Err(format!(
                    "{what}: `run --wait 3s` ended after {took:?} with {code}; stderr {stderr:?}"
                ));
            }
            Ok(())
        };
        // Redis Cluster clients follow the nodes' own addresses, around the
        // proxies, once connected.
        if c.name != "redis cluster" {
            let k = key("stall", c);
            let started = work.join("started");
            let stop = work.join("stop");
            let _ends = Ends(&stop);
            let holder = spawn(
                c,
                &[
                    "run",
                    "--key",
                    &k,
                    "--",
                    "sh",
                    "-c",
                    &hold_until(&started, &stop),
                ],
            )?;
            wait_for(&started, Duration::from_secs(60))?;
            let start = Instant::now();
            let waiter = spawn(&via, &["run", "--key", &k, "--wait", "3s", "--", "true"])?;
            std::thread::sleep(Duration::from_millis(1500));
            proxies
                .iter()
                .for_each(fencelock_testkit::FaultProxy::blackhole);
            let waited = ended(waiter, start, "stalled while waiting");
            proxies
                .iter()
                .for_each(fencelock_testkit::FaultProxy::restore);
            drop(_ends);
            // The holder is not the subject here: on a loaded machine its
            // first connect may be asked again (one warning line).
            let (code, stderr) = finish(holder, Duration::from_secs(60))?;
            if code != 0 {
                return Err(format!("holder: exit {code}, stderr {stderr:?}"));
            }
            waited?;
        }
        proxies
            .iter()
            .for_each(fencelock_testkit::FaultProxy::blackhole);
        let start = Instant::now();
        let child = spawn(
            &via,
            &[
                "run",
                "--key",
                &key("stall-connect", c),
                "--wait",
                "3s",
                "--",
                "true",
            ],
        )?;
        ended(child, start, "stalled before the connect")
    });
}
