//! Throw-away server processes on free loopback ports, and signals for fault tests.

use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

/// A free TCP port on 127.0.0.1 for a server to listen on: never one this
/// process handed out before, and below the kernel's ephemeral range.
///
/// A port the kernel picks for `bind(0)` comes from the ephemeral range,
/// where every outgoing connection also takes its local port: between this
/// call and the server's own bind, a client connecting anywhere (a peer of an
/// ensemble retrying, a proxy) could take it, and the server could not bind
/// (a ZooKeeper member that cannot bind its election port never joins). So
/// the port is drawn from 10000 up to the range's start, checked free by a
/// bind, and remembered; another process may still take it, which the
/// server's start then reports.
///
/// # Panics
///
/// If no port can be bound on loopback at all.
pub fn free_port() -> u16 {
    static HANDED_OUT: Mutex<Vec<u16>> = Mutex::new(Vec::new());
    let mut handed = HANDED_OUT.lock().unwrap_or_else(|p| p.into_inner());
    let top = ephemeral_start().saturating_sub(1);
    if top > 12_000 {
        for _ in 0..10_000 {
            let port = fastrand::u16(10_000..=top);
            if !handed.contains(&port) && TcpListener::bind(("127.0.0.1", port)).is_ok() {
                handed.push(port);
                return port;
            }
        }
    }
    // No room below the ephemeral range: take the kernel's pick.
    loop {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .unwrap_or_else(|e| panic!("cannot bind a loopback port: {e}"));
        if !handed.contains(&port) {
            handed.push(port);
            return port;
        }
    }
}

/// The first port of the kernel's ephemeral range (Linux's default if it
/// cannot be read).
fn ephemeral_start() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768)
}

/// Waits until something accepts TCP connections on `addr`.
///
/// # Errors
///
/// [`io::ErrorKind::TimedOut`] after `timeout`.
pub fn wait_for_port(addr: SocketAddr, timeout: Duration) -> io::Result<()> {
    let start = Instant::now();
    loop {
        if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
            return Ok(());
        }
        if start.elapsed() > timeout {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("nothing listens on {addr} after {timeout:?}"),
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The newest installed PostgreSQL's program `name`
/// (`/usr/lib/postgresql/VERSION/bin/NAME`, as Debian installs it).
///
/// # Errors
///
/// If no PostgreSQL version is installed.
pub fn postgres_program(name: &str) -> io::Result<std::path::PathBuf> {
    let newest = std::fs::read_dir("/usr/lib/postgresql")?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter_map(|p| {
            let v = p.file_name()?.to_str()?.parse::<u32>().ok()?;
            Some((v, p))
        })
        .max_by_key(|(v, _)| *v)
        .ok_or_else(|| io::Error::other("no PostgreSQL version in /usr/lib/postgresql"))?;
    Ok(newest.1.join("bin").join(name))
}

/// The uid and gid of the account `name` (PostgreSQL refuses to run as root).
///
/// # Errors
///
/// If there is no such account.
pub fn account_ids(name: &str) -> io::Result<(u32, u32)> {
    let id = |flag: &str| -> io::Result<u32> {
        let out = Command::new("id").args([flag, name]).output()?;
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .map_err(|_| io::Error::other(format!("no account {name:?}")))
    };
    Ok((id("-u")?, id("-g")?))
}

/// Sends `signal` to process `pid`.
///
/// # Errors
///
/// If the process does not exist or may not be signalled.
pub fn send_signal(pid: u32, signal: Signal) -> io::Result<()> {
    let pid = i32::try_from(pid).map_err(|_| io::Error::other("pid out of range"))?;
    kill(Pid::from_raw(pid), signal).map_err(io::Error::from)
}

/// A server process the test owns: started on a port, killed on drop.
pub struct ServerProcess {
    name: String,
    child: Option<Child>,
    port: u16,
}

impl ServerProcess {
    /// Starts `cmd` (which must listen on 127.0.0.1:`port`) and waits until the
    /// port answers.
    ///
    /// # Errors
    ///
    /// If the program cannot be started, exits early, or never listens.
    pub fn spawn(
        name: &str,
        mut cmd: Command,
        port: u16,
        timeout: Duration,
    ) -> io::Result<ServerProcess> {
        let child = cmd
            .spawn()
            .map_err(|e| io::Error::new(e.kind(), format!("cannot start {name} ({cmd:?}): {e}")))?;
        let mut server = ServerProcess {
            name: name.to_string(),
            child: Some(child),
            port,
        };
        let addr = server.addr();
        let start = Instant::now();
        loop {
            if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
                return Ok(server);
            }
            if let Some(child) = server.child.as_mut()
                && let Some(status) = child.try_wait()?
            {
                return Err(io::Error::other(format!(
                    "{name} exited early with {status}"
                )));
            }
            if start.elapsed() > timeout {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("{name} did not listen on {addr} within {timeout:?}"),
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `127.0.0.1:port`.
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// The process id (`None` once killed).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// SIGKILLs the server and reaps it. A server started as the leader of
    /// its own process group (`CommandExt::process_group(0)`) is killed with
    /// the whole group, so that no worker process of it (PostgreSQL's
    /// backends) outlives it.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            if let Ok(pid) = i32::try_from(child.id()) {
                let _ = nix::sys::signal::killpg(Pid::from_raw(pid), Signal::SIGKILL);
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGSTOPs the server (it keeps its sockets but answers nothing).
    ///
    /// # Errors
    ///
    /// If it is not running.
    pub fn pause(&self) -> io::Result<()> {
        self.signal(Signal::SIGSTOP)
    }

    /// SIGCONTs a paused server.
    ///
    /// # Errors
    ///
    /// If it is not running.
    pub fn resume(&self) -> io::Result<()> {
        self.signal(Signal::SIGCONT)
    }

    fn signal(&self, signal: Signal) -> io::Result<()> {
        match self.pid() {
            Some(pid) => send_signal(pid, signal),
            None => Err(io::Error::other(format!("{} is not running", self.name))),
        }
    }
}

/// A standalone ZooKeeper server (the Debian package's jar) on a free port,
/// with its data in `dir` and the given lines added to its `zoo.cfg`
/// (`"maxSessionTimeout=4000"`); ticks are 500 ms.
///
/// # Errors
///
/// As [`ServerProcess::spawn`] (a JVM may take a minute to listen), or if
/// `dir` cannot be written.
pub fn zookeeper(dir: &std::path::Path, extra_config: &str) -> io::Result<ServerProcess> {
    zookeeper_on(dir, free_port(), extra_config)
}

/// [`zookeeper`] on `port`: called again with the same `dir` and `port` after
/// a kill, it restarts the server on its data.
///
/// # Errors
///
/// As [`zookeeper`].
pub fn zookeeper_on(
    dir: &std::path::Path,
    port: u16,
    extra_config: &str,
) -> io::Result<ServerProcess> {
    std::fs::create_dir_all(dir.join("data"))?;
    let cfg = format!(
        "tickTime=500\ndataDir={}\nclientPort={port}\nclientPortAddress=127.0.0.1\nadmin.enableServer=false\n{extra_config}\n",
        dir.join("data").display()
    );
    std::fs::write(dir.join("zoo.cfg"), cfg)?;
    let mut cmd = Command::new("java");
    cmd.args([
        "-cp",
        "/etc/zookeeper/conf_example:/usr/share/java/zookeeper.jar",
    ])
    .arg(format!("-Dzookeeper.log.dir={}", dir.display()))
    .arg("org.apache.zookeeper.server.quorum.QuorumPeerMain")
    .arg(dir.join("zoo.cfg"))
    .stdout(std::process::Stdio::null())
    .stderr(std::process::Stdio::null());
    ServerProcess::spawn("zookeeper", cmd, port, Duration::from_secs(60))
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        if let Some(pid) = self.pid() {
            let _ = send_signal(pid, Signal::SIGCONT);
        }
        self.kill();
    }
}
