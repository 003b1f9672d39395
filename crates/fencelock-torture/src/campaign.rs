//! The controller: starts the register, the proxies and the client processes,
//! injects faults from the seed, heals them, stops everything and checks the
//! history.

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use fencelock::Hold;
use fencelock_testkit::{FaultProxy, Signal, send_signal};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, Command};
use tokio::task::JoinHandle;

use crate::check::{FaultRecord, Findings, History, check};
use crate::endpoints::Endpoints;
use crate::events::Event;
use crate::faults::FaultKind;
use crate::register::Register;
use crate::servers::{Servers, SpawnKind};

/// What to torture and how.
#[derive(Debug, Clone)]
pub struct Config {
    /// The backend URL (ignored with `spawn`, which makes its own).
    pub backend: Option<String>,
    /// Start private servers of this kind instead.
    pub spawn: Option<SpawnKind>,
    /// Client processes.
    pub clients: u32,
    /// How long faults are injected (then everything heals and settles).
    pub duration: Duration,
    /// Which faults to use.
    pub faults: Vec<FaultKind>,
    /// The seed of every random choice (fault times, targets, client choices).
    pub seed: u64,
    /// The usual TTL of a hold (each acquire draws its own around it).
    pub ttl: Duration,
    /// Negative control: clients write on after their lease was lost.
    pub ignore_lost: bool,
    /// The program and arguments that start one client (the binary's hidden
    /// subcommand); the client flags are appended.
    pub client_command: Vec<String>,
    /// Write the whole history here.
    pub history: Option<PathBuf>,
}

/// What a campaign found.
#[derive(Debug, Clone)]
pub struct Report {
    /// The backend's name (the URL's scheme, or the spawned kind).
    pub backend: String,
    /// The URL, passwords redacted.
    pub url: String,
    /// Whether the backend gives fencing tokens.
    pub fencing: bool,
    /// The seed.
    pub seed: u64,
    /// Client processes at a time.
    pub clients: u32,
    /// Seconds of faults.
    pub duration_s: f64,
    /// Faults injected, by kind.
    pub injected: BTreeMap<String, usize>,
    /// Faults asked for but skipped, with why.
    pub skipped: Vec<String>,
    /// The checks' findings.
    pub findings: Findings,
}

impl Report {
    /// One JSON object.
    pub fn to_json(&self) -> serde_json::Value {
        let f = &self.findings;
        serde_json::json!({
            "backend": self.backend,
            "url": self.url,
            "fencing": self.fencing,
            "seed": self.seed,
            "clients": self.clients,
            "duration_s": self.duration_s,
            "faults_injected": self.injected,
            "faults_skipped": self.skipped,
            "grants": f.grants,
            "lost": f.lost,
            "timeouts": f.timeouts,
            "errors": f.errors,
            "cancelled": f.cancelled,
            "overlaps": f.overlaps,
            "over_permits": f.over_permits,
            "token_regressions": f.token_regressions,
            "superseded_writes_accepted": f.superseded_accepted,
            "stale_writes_rejected": f.stale_rejected,
            "writes_accepted": f.writes_accepted,
            "lost_on_arrival": f.lost_on_arrival,
            "stuck_waits": f.stuck_waits,
            "late_returns": f.late_returns,
            "unavailable": f.unavailable(),
            "max_recovery_ms": f.max_recovery_ms,
            "max_unavailable_ms": f.max_unavailable_ms,
            "violations": f.violations(),
            "examples": f.examples,
        })
    }

    /// A few lines for people.
    pub fn to_text(&self) -> String {
        let f = &self.findings;
        let injected: Vec<String> = self
            .injected
            .iter()
            .map(|(k, n)| format!("{k} {n}"))
            .collect();
        let mut s = format!(
            "torture {} seed {} — {} clients, {:.0} s; faults: {}\n\
             grants {} (lost {}, timeouts {}, errors {}, cancelled {}); writes accepted {}, stale rejected {}\n\
             overlaps {}  over-permits {}  token regressions {}  superseded writes accepted {}  lost on arrival {}  stuck waits {}  late returns {}\n\
             longest recovery after a fault {} ms; longest without a holder {} ms\n",
            self.url,
            self.seed,
            self.clients,
            self.duration_s,
            if injected.is_empty() {
                "none".to_string()
            } else {
                injected.join(", ")
            },
            f.grants,
            f.lost,
            f.timeouts,
            f.errors,
            f.cancelled,
            f.writes_accepted,
            f.stale_rejected,
            f.overlaps,
            f.over_permits,
            f.token_regressions,
            f.superseded_accepted,
            f.lost_on_arrival,
            f.stuck_waits,
            f.late_returns,
            f.max_recovery_ms,
            f.max_unavailable_ms
        );
        for skip in &self.skipped {
            s.push_str(&format!("skipped: {skip}\n"));
        }
        for e in &f.examples {
            s.push_str(&format!("VIOLATION: {e}\n"));
        }
        if f.violations() > 0 {
            s.push_str(&format!("reproduce with --seed {}\n", self.seed));
        }
        s
    }
}

/// The state the clients' readers share with the controller.
#[derive(Default)]
struct Shared {
    events: Vec<(String, Event)>,
    /// Holds each client has open right now.
    holding: HashMap<String, usize>,
    /// When each client's output ended: its death, whoever caused it.
    gone: HashMap<String, u128>,
}

struct Client {
    name: String,
    child: Child,
    stdin: Option<ChildStdin>,
    reader: JoinHandle<()>,
    stopped: bool,
    dead: bool,
}

struct Slot {
    proxies: Vec<FaultProxy>,
    url: String,
    incarnation: u32,
    client: Client,
    /// A proxy or clock fault is active on this slot.
    busy: bool,
}

/// How to undo an active fault.
enum Heal {
    Cont(usize),
    Thaw(usize),
    Restore(usize),
    CutRestore(usize),
    NoLatency(usize),
    ClockZero(usize),
    Respawn(usize),
    Members(Vec<usize>, bool),
    FailOver,
}

struct Active {
    record: FaultRecord,
    heal_at: Instant,
    heal: Heal,
}

struct Campaign {
    cfg: Config,
    shared: Arc<Mutex<Shared>>,
    slots: Vec<Slot>,
    register: Register,
    servers: Option<Servers>,
    log: std::fs::File,
    prefix: String,
}

fn lock(s: &Mutex<Shared>) -> std::sync::MutexGuard<'_, Shared> {
    s.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Runs one campaign.
///
/// # Errors
///
/// If the servers, proxies, register or clients cannot be started.
pub async fn run(cfg: Config) -> io::Result<Report> {
    let (servers, url) = target(&cfg)?;
    let probe = fencelock::connect(&url).await.map_err(|e| {
        io::Error::other(format!(
            "cannot reach {}: {e}",
            fencelock::backend::redact_url(&url)
        ))
    })?;
    let fencing = probe.capabilities().fencing;
    drop(probe);
    let scheme = url.split("://").next().unwrap_or("").to_string();
    let endpoints = Endpoints::parse(&url);
    // Cluster and Sentinel clients reach data nodes the proxies do not stand before.
    let topology = scheme.contains("cluster") || scheme.contains("sentinel");
    let (faults, skipped) = usable_faults(&cfg, endpoints.is_some(), topology);
    let register = Register::start().await?;
    let log_dir = tempfile::Builder::new()
        .prefix("fencelock-torture-log-")
        .tempdir()?;
    let log = std::fs::File::create(log_dir.path().join("clients.log"))?;
    let prefix = format!(
        "torture/{}-{}-{}",
        cfg.seed,
        std::process::id(),
        fastrand::u32(..)
    );
    let mut c = Campaign {
        cfg: cfg.clone(),
        shared: Arc::default(),
        slots: Vec::new(),
        register,
        servers,
        log,
        prefix,
    };
    c.start_clients(&url, endpoints.as_ref()).await?;
    let mut records = Vec::new();
    let started = Instant::now();
    c.inject(&faults, &mut records).await;
    // Let every lease settle after the last healing, then stop the clients.
    tokio::time::sleep(c.cfg.ttl * crate::client::LONGEST_TTL).await;
    for i in 0..c.slots.len() {
        c.stop_client(i, false).await;
    }
    let history = c.history(records);
    if let Some(path) = &c.cfg.history {
        write_history(path, &history)?;
    }
    if history.events.is_empty() {
        let text = std::fs::read_to_string(log_dir.path().join("clients.log")).unwrap_or_default();
        return Err(io::Error::other(format!(
            "no client reported anything; their output:\n{}",
            text.lines().take(20).collect::<Vec<_>>().join("\n")
        )));
    }
    let mut injected = BTreeMap::new();
    for r in &history.faults {
        *injected.entry(r.kind.clone()).or_insert(0) += 1;
    }
    Ok(Report {
        backend: cfg.spawn.map_or(scheme, |k| k.name().to_string()),
        url: fencelock::backend::redact_url(&url),
        fencing,
        seed: cfg.seed,
        clients: cfg.clients,
        duration_s: started.elapsed().as_secs_f64(),
        injected,
        skipped,
        findings: check(&history),
    })
}

/// The servers to start (`--spawn`), if any, and the URL of the backend.
fn target(cfg: &Config) -> io::Result<(Option<Servers>, String)> {
    let servers = match cfg.spawn {
        Some(kind) => Some(tokio::task::block_in_place(|| Servers::start(kind))?),
        None => None,
    };
    let url = match (&servers, &cfg.backend) {
        (Some(s), _) => s.url(),
        (None, Some(u)) => u.trim().to_string(),
        (None, None) => return Err(io::Error::other("give --backend URL or --spawn KIND")),
    };
    Ok((servers, url))
}

/// The faults asked for that this target allows, and a note per fault left out.
fn usable_faults(cfg: &Config, proxied: bool, cluster: bool) -> (Vec<FaultKind>, Vec<String>) {
    let mut faults = Vec::new();
    let mut skipped = Vec::new();
    for f in &cfg.faults {
        match f.unsupported(proxied, cluster, cfg.spawn) {
            None => faults.push(*f),
            Some(why) => skipped.push(format!("{}: {why}", f.name())),
        }
    }
    (faults, skipped)
}

impl Campaign {
    /// Starts the clients, each behind its own fault proxies when the URL's
    /// endpoints can be proxied.
    async fn start_clients(&mut self, url: &str, endpoints: Option<&Endpoints>) -> io::Result<()> {
        let upstreams = match endpoints {
            Some(e) => e.addrs()?,
            None => Vec::new(),
        };
        for i in 0..self.cfg.clients as usize {
            let mut proxies = Vec::new();
            for up in &upstreams {
                proxies.push(FaultProxy::start(*up).await?);
            }
            let via: Vec<SocketAddr> = proxies.iter().map(FaultProxy::addr).collect();
            let client_url = match endpoints {
                Some(e) => e.through(&via),
                None => url.to_string(),
            };
            let client = self.spawn_client(i, 0, &client_url)?;
            self.slots.push(Slot {
                proxies,
                url: client_url,
                incarnation: 0,
                client,
                busy: false,
            });
        }
        Ok(())
    }

    /// The whole history: the clients' events, the register's writes and the
    /// faults injected.
    fn history(&self, faults: Vec<FaultRecord>) -> History {
        let s = lock(&self.shared);
        History {
            events: s.events.clone(),
            gone_ns: s.gone.clone(),
            writes: self.register.writes(),
            faults,
            ttl_ns: self.cfg.ttl.as_nanos() * u128::from(crate::client::LONGEST_TTL),
        }
    }
}

fn write_history(path: &std::path::Path, h: &History) -> io::Result<()> {
    use std::io::Write;
    let mut f = io::BufWriter::new(std::fs::File::create(path)?);
    for (client, e) in &h.events {
        writeln!(f, "{client} {}", e.to_line())?;
    }
    for (client, ns) in &h.gone_ns {
        writeln!(f, "{client} GONE {ns}")?;
    }
    for w in &h.writes {
        writeln!(
            f,
            "REGISTER {} {} {} {} {}",
            w.at_ns,
            w.key,
            w.token.map_or("-".into(), |t| t.to_string()),
            w.hold,
            if w.accepted { "accepted" } else { "rejected" }
        )?;
    }
    for r in &h.faults {
        writeln!(
            f,
            "FAULT {} {} {} {}",
            r.kind, r.target, r.start_ns, r.heal_ns
        )?;
    }
    f.flush()
}

impl Campaign {
    fn spawn_client(&mut self, slot: usize, incarnation: u32, url: &str) -> io::Result<Client> {
        let name = if incarnation == 0 {
            format!("c{slot}")
        } else {
            format!("c{slot}r{incarnation}")
        };
        let (program, args) = self
            .cfg
            .client_command
            .split_first()
            .ok_or_else(|| io::Error::other("no client command"))?;
        let seed = self
            .cfg
            .seed
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .wrapping_add((slot as u64) << 16 | u64::from(incarnation));
        let mut cmd = Command::new(program);
        cmd.args(args)
            .args(["--backend", url, "--name", &name])
            .args(["--register", &self.register.addr().to_string()])
            .args([
                "--ttl",
                &humantime::format_duration(self.cfg.ttl).to_string(),
            ])
            .args(["--seed", &seed.to_string(), "--prefix", &self.prefix])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(self.log.try_clone()?))
            .kill_on_drop(true);
        if self.cfg.ignore_lost {
            cmd.arg("--ignore-lost");
        }
        let mut child = cmd.spawn()?;
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| io::Error::other("client has no stdout"))?;
        let shared = self.shared.clone();
        let who = name.clone();
        let reader = tokio::spawn(async move {
            let mut lines = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                if let Some(e) = Event::parse(&line) {
                    let mut s = lock(&shared);
                    let open = s.holding.entry(who.clone()).or_insert(0);
                    match &e {
                        Event::Grant { .. } => *open += 1,
                        Event::End { .. } => *open = open.saturating_sub(1),
                        _ => {}
                    }
                    s.events.push((who.clone(), e));
                }
            }
            lock(&shared).gone.insert(who, Hold::now_ns());
        });
        Ok(Client {
            name,
            stdin: child.stdin.take(),
            child,
            reader,
            stopped: false,
            dead: false,
        })
    }

    /// Ends slot `i`'s client: SIGKILL (`kill`) or closing its stdin; its
    /// reader records when it was gone.
    async fn stop_client(&mut self, i: usize, kill: bool) {
        let c = &mut self.slots[i].client;
        if c.dead {
            return;
        }
        if c.stopped {
            if let Some(pid) = c.child.id() {
                let _ = send_signal(pid, Signal::SIGCONT);
            }
            c.stopped = false;
        }
        if kill {
            let _ = c.child.start_kill();
        }
        c.stdin = None;
        if tokio::time::timeout(Duration::from_secs(10), c.child.wait())
            .await
            .is_err()
        {
            let _ = c.child.start_kill();
            let _ = c.child.wait().await;
        }
        let _ = (&mut c.reader).await;
        c.dead = true;
    }

    fn rng_dur(rng: &mut fastrand::Rng, base: Duration, lo: f64, hi: f64) -> Duration {
        base.mul_f64(lo + (hi - lo) * rng.f64())
    }

    /// Injects faults until the duration is over, then heals what is active.
    async fn inject(&mut self, kinds: &[FaultKind], records: &mut Vec<FaultRecord>) {
        let mut rng = fastrand::Rng::with_seed(self.cfg.seed);
        let end = Instant::now() + self.cfg.duration;
        let ttl = self.cfg.ttl;
        let mut active: Vec<Active> = Vec::new();
        let mut next = Instant::now() + Self::rng_dur(&mut rng, ttl, 0.5, 1.5);
        loop {
            let now = Instant::now();
            let due = active.iter().map(|a| a.heal_at).min();
            if now >= end {
                break;
            }
            let wake = due.map_or(next, |d| d.min(next)).min(end);
            tokio::time::sleep_until(wake.into()).await;
            let now = Instant::now();
            let (heal_now, keep): (Vec<Active>, Vec<Active>) =
                active.into_iter().partition(|a| a.heal_at <= now);
            active = keep;
            for a in heal_now {
                records.push(self.heal(a).await);
            }
            if now >= next && !kinds.is_empty() {
                next = now + Self::rng_dur(&mut rng, ttl, 0.3, 1.5);
                if active.len() < 2 {
                    let kind = kinds[rng.usize(..kinds.len())];
                    if let Some(a) = self.start_fault(kind, &mut rng).await {
                        active.push(a);
                    }
                }
            }
        }
        for a in active {
            // A server that lost its data stays down as long as drawn, even
            // past the end: a Redlock instance back early would break the
            // assumption the campaign means to keep (ARCHITECTURE §8).
            if matches!(a.heal, Heal::Members(_, false)) {
                tokio::time::sleep_until(a.heal_at.into()).await;
            }
            records.push(self.heal(a).await);
        }
    }

    /// A slot whose client is alive, not stopped and (for proxy faults) not
    /// under another fault; a holder if `prefer_holder` and one holds.
    fn pick(&self, rng: &mut fastrand::Rng, need_idle: bool, prefer_holder: bool) -> Option<usize> {
        let ok: Vec<usize> = (0..self.slots.len())
            .filter(|&i| {
                let s = &self.slots[i];
                !(s.client.dead || s.client.stopped || need_idle && s.busy)
            })
            .collect();
        if prefer_holder {
            let shared = lock(&self.shared);
            let holders: Vec<usize> = ok
                .iter()
                .copied()
                .filter(|&i| {
                    shared
                        .holding
                        .get(&self.slots[i].client.name)
                        .copied()
                        .unwrap_or(0)
                        > 0
                })
                .collect();
            if !holders.is_empty() {
                return Some(holders[rng.usize(..holders.len())]);
            }
        }
        (!ok.is_empty()).then(|| ok[rng.usize(..ok.len())])
    }

    async fn start_fault(&mut self, kind: FaultKind, rng: &mut fastrand::Rng) -> Option<Active> {
        let now = Instant::now();
        let (target, heal, last) = match kind {
            FaultKind::Pause => self.pause(rng)?,
            FaultKind::Freeze => self.freeze(rng)?,
            FaultKind::Kill => self.kill(rng).await?,
            FaultKind::Partition | FaultKind::LostReply | FaultKind::Latency => {
                self.network(kind, rng)?
            }
            FaultKind::Clock => self.clock(rng).await?,
            FaultKind::Restart
            | FaultKind::RestartEmpty
            | FaultKind::Leader
            | FaultKind::Minority
            | FaultKind::Majority => self.server_fault(kind, rng)?,
            FaultKind::Failover => {
                let ttl = self.cfg.ttl;
                let master = self.servers.as_mut()?.isolate_master()?;
                (
                    format!("master {master}"),
                    Heal::FailOver,
                    Self::rng_dur(rng, ttl, 0.2, 1.0),
                )
            }
        };
        Some(Active {
            record: FaultRecord {
                kind: kind.name().to_string(),
                target,
                start_ns: Hold::now_ns(),
                heal_ns: 0,
            },
            heal_at: now + last,
            heal,
        })
    }

    /// SIGSTOP of a client that holds, past its TTL.
    fn pause(&mut self, rng: &mut fastrand::Rng) -> Option<(String, Heal, Duration)> {
        let ttl = self.cfg.ttl;
        let i = self.pick(rng, false, true)?;
        let c = &mut self.slots[i].client;
        send_signal(c.child.id()?, Signal::SIGSTOP).ok()?;
        c.stopped = true;
        Some((
            c.name.clone(),
            Heal::Cont(i),
            Self::rng_dur(rng, ttl, 1.2, 2.5),
        ))
    }

    /// A frozen VM: the client's proxies hold what it sends next, and the
    /// client is SIGSTOPped, past its TTL.
    fn freeze(&mut self, rng: &mut fastrand::Rng) -> Option<(String, Heal, Duration)> {
        let ttl = self.cfg.ttl;
        let i = self.pick(rng, true, true)?;
        let s = &mut self.slots[i];
        let pid = s.client.child.id()?;
        s.proxies.iter().for_each(FaultProxy::blackhole);
        if send_signal(pid, Signal::SIGSTOP).is_err() {
            s.proxies.iter().for_each(FaultProxy::restore);
            return None;
        }
        s.busy = true;
        s.client.stopped = true;
        Some((
            s.client.name.clone(),
            Heal::Thaw(i),
            Self::rng_dur(rng, ttl, 1.2, 2.5),
        ))
    }

    /// SIGKILL of a client; a new one takes its place when it heals.
    async fn kill(&mut self, rng: &mut fastrand::Rng) -> Option<(String, Heal, Duration)> {
        let i = self.pick(rng, false, true)?;
        let name = self.slots[i].client.name.clone();
        self.stop_client(i, true).await;
        Some((
            name,
            Heal::Respawn(i),
            Self::rng_dur(rng, self.cfg.ttl, 0.2, 1.0),
        ))
    }

    /// A partition, lost replies or added latency between one client and the
    /// servers (its proxies).
    fn network(
        &mut self,
        kind: FaultKind,
        rng: &mut fastrand::Rng,
    ) -> Option<(String, Heal, Duration)> {
        let ttl = self.cfg.ttl;
        let i = self.pick(rng, true, true)?;
        let s = &mut self.slots[i];
        s.busy = true;
        let heal = match kind {
            FaultKind::Partition => {
                s.proxies.iter().for_each(FaultProxy::blackhole);
                Heal::Restore(i)
            }
            FaultKind::LostReply => {
                s.proxies.iter().for_each(FaultProxy::drop_replies);
                Heal::CutRestore(i)
            }
            _ => {
                let d = Duration::from_millis(rng.u64(20..=300));
                s.proxies.iter().for_each(|p| p.set_latency(d));
                Heal::NoLatency(i)
            }
        };
        let last = match kind {
            FaultKind::Partition => Self::rng_dur(rng, ttl, 0.5, 2.0),
            FaultKind::LostReply => Self::rng_dur(rng, ttl, 0.1, 0.6),
            _ => Self::rng_dur(rng, ttl, 0.5, 1.5),
        };
        Some((s.client.name.clone(), heal, last))
    }

    /// A client's clock set off by 1 to 5 s, either way.
    async fn clock(&mut self, rng: &mut fastrand::Rng) -> Option<(String, Heal, Duration)> {
        let ttl = self.cfg.ttl;
        let i = self.pick(rng, true, false)?;
        let ms = rng.i64(1000..=5000) * if rng.bool() { 1 } else { -1 };
        let s = &mut self.slots[i];
        let stdin = s.client.stdin.as_mut()?;
        stdin
            .write_all(format!("clock {ms}\n").as_bytes())
            .await
            .ok()?;
        s.busy = true;
        Some((
            format!("{} by {ms} ms", s.client.name),
            Heal::ClockZero(i),
            Self::rng_dur(rng, ttl, 1.0, 3.0),
        ))
    }

    /// Servers killed (restarted with or without their data when it heals):
    /// one, the leader, a minority of followers or a majority; one server
    /// fault at a time.
    fn server_fault(
        &mut self,
        kind: FaultKind,
        rng: &mut fastrand::Rng,
    ) -> Option<(String, Heal, Duration)> {
        let ttl = self.cfg.ttl;
        let spawn = self.cfg.spawn;
        let servers = self.servers.as_mut()?;
        let up: Vec<usize> = (0..servers.len()).filter(|&i| servers.is_up(i)).collect();
        if up.len() < servers.len() {
            return None;
        }
        let n = servers.len();
        let members: Vec<usize> = match kind {
            FaultKind::Leader => vec![tokio::task::block_in_place(|| servers.leader())?],
            FaultKind::Minority => {
                let k = if n == 5 { 2 } else { 1 };
                let mut all: Vec<usize> = (0..n).collect();
                if let Some(l) = tokio::task::block_in_place(|| servers.leader()) {
                    all.retain(|&m| m != l); // a minority of followers
                }
                rng.shuffle(&mut all);
                all.into_iter().take(k).collect()
            }
            FaultKind::Majority => {
                let mut all: Vec<usize> = (0..n).collect();
                rng.shuffle(&mut all);
                all.into_iter().take(n / 2 + 1).collect()
            }
            _ => vec![rng.usize(..n)],
        };
        for &m in &members {
            servers.kill(m);
        }
        let keep = kind != FaultKind::RestartEmpty;
        let names: Vec<String> = members.iter().map(|m| format!("server {m}")).collect();
        // A Redlock instance that lost its data must stay down longer
        // than a TTL (the documented assumption); a whole server need not.
        let down = if !keep && spawn == Some(SpawnKind::Redlock) {
            ttl + Self::rng_dur(rng, ttl, 0.2, 1.0)
        } else {
            Self::rng_dur(rng, ttl, 0.2, 1.5)
        };
        Some((names.join("+"), Heal::Members(members, keep), down))
    }

    async fn heal(&mut self, mut a: Active) -> FaultRecord {
        match a.heal {
            Heal::Thaw(i) => {
                let s = &mut self.slots[i];
                s.proxies.iter().for_each(FaultProxy::restore);
                if let Some(pid) = s.client.child.id() {
                    let _ = send_signal(pid, Signal::SIGCONT);
                }
                s.client.stopped = false;
                s.busy = false;
            }
            Heal::Cont(i) => {
                let c = &mut self.slots[i].client;
                if let Some(pid) = c.child.id() {
                    let _ = send_signal(pid, Signal::SIGCONT);
                }
                c.stopped = false;
            }
            Heal::Restore(i) | Heal::CutRestore(i) | Heal::NoLatency(i) => {
                let s = &mut self.slots[i];
                for p in &s.proxies {
                    if matches!(a.heal, Heal::CutRestore(_)) {
                        p.cut();
                    }
                    p.set_latency(Duration::ZERO);
                }
                if matches!(a.heal, Heal::CutRestore(_)) {
                    // Let the cut reach every connection before traffic flows again.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                s.proxies.iter().for_each(FaultProxy::restore);
                s.busy = false;
            }
            Heal::ClockZero(i) => {
                let s = &mut self.slots[i];
                if let Some(stdin) = s.client.stdin.as_mut() {
                    let _ = stdin.write_all(b"clock 0\n").await;
                }
                s.busy = false;
            }
            Heal::Respawn(i) => {
                let inc = self.slots[i].incarnation + 1;
                let url = self.slots[i].url.clone();
                match self.spawn_client(i, inc, &url) {
                    Ok(c) => {
                        self.slots[i].client = c;
                        self.slots[i].incarnation = inc;
                    }
                    Err(e) => eprintln!("torture: cannot start a client again: {e}"),
                }
            }
            Heal::FailOver => {
                if let Some(servers) = self.servers.as_mut()
                    && let Err(e) = tokio::task::block_in_place(|| servers.fail_over())
                {
                    eprintln!("torture: the failover did not complete: {e}");
                }
            }
            Heal::Members(ref members, keep) => {
                if let Some(servers) = self.servers.as_mut() {
                    for &m in members {
                        if let Err(e) = tokio::task::block_in_place(|| servers.restart(m, keep)) {
                            eprintln!("torture: server {m} did not come back: {e}");
                        }
                    }
                }
            }
        }
        a.record.heal_ns = Hold::now_ns();
        a.record
    }
}
