//! A TCP fault proxy: put it between a client and a real server, then add
//! latency, cut the connections, or black-hole them, and restore.

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// What the proxy does with traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ProxyMode {
    /// Forward everything (after the configured latency).
    Pass,
    /// Keep connections open but forward nothing: a partition where packets are
    /// dropped. New connections are accepted and hang, and a side that closes
    /// is not seen closing by the other until the partition heals (the close
    /// is held like data).
    Blackhole,
    /// Close every connection and every new one at once: a peer that resets.
    Reset,
    /// Forward requests to the server but hold its replies back: the request
    /// is executed and the reply is lost (until [`FaultProxy::restore`]).
    DropReplies,
}

/// Which way a chunk travels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Direction {
    ToServer,
    ToClient,
}

#[derive(Debug, Clone, Copy)]
struct Settings {
    mode: ProxyMode,
    latency: Duration,
}

/// A TCP proxy on a free loopback port forwarding to `upstream`.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use fencelock_testkit::FaultProxy;
/// use tokio::io::{AsyncReadExt, AsyncWriteExt};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> std::io::Result<()> {
/// // An echo server stands in for a real one.
/// let server = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
/// let upstream = server.local_addr()?;
/// tokio::spawn(async move {
///     while let Ok((mut s, _)) = server.accept().await {
///         tokio::spawn(async move {
///             let mut b = [0u8; 64];
///             while let Ok(n) = s.read(&mut b).await { if n == 0 || s.write_all(&b[..n]).await.is_err() { break } }
///         });
///     }
/// });
/// let proxy = FaultProxy::start(upstream).await?;
/// proxy.set_latency(Duration::from_millis(5));
/// let mut c = tokio::net::TcpStream::connect(proxy.addr()).await?;
/// c.write_all(b"ping").await?;
/// let mut b = [0u8; 4];
/// c.read_exact(&mut b).await?;
/// assert_eq!(&b, b"ping");
/// proxy.cut();
/// let mut rest = Vec::new();
/// assert_eq!(c.read_to_end(&mut rest).await.unwrap_or(0), 0); // closed by the proxy
/// # Ok(()) }
/// ```
pub struct FaultProxy {
    addr: SocketAddr,
    settings: watch::Sender<Settings>,
    task: JoinHandle<()>,
}

impl FaultProxy {
    /// Starts forwarding from a free loopback port to `upstream`.
    ///
    /// # Errors
    ///
    /// If no loopback port can be bound.
    pub async fn start(upstream: SocketAddr) -> io::Result<FaultProxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (settings, rx) = watch::channel(Settings {
            mode: ProxyMode::Pass,
            latency: Duration::ZERO,
        });
        let task = tokio::spawn(accept_loop(listener, upstream, rx));
        Ok(FaultProxy {
            addr,
            settings,
            task,
        })
    }

    /// The address clients should connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Delays every forwarded chunk by `latency`, in both directions.
    pub fn set_latency(&self, latency: Duration) {
        self.settings.send_modify(|s| s.latency = latency);
    }

    /// Closes every connection, and every new one, until [`FaultProxy::restore`].
    pub fn cut(&self) {
        self.set_mode(ProxyMode::Reset);
    }

    /// Stops forwarding but keeps connections open (packets vanish), until
    /// [`FaultProxy::restore`].
    pub fn blackhole(&self) {
        self.set_mode(ProxyMode::Blackhole);
    }

    /// Forwards requests but holds replies back, until [`FaultProxy::restore`]
    /// or [`FaultProxy::cut`] (which drops the held replies with the connection).
    pub fn drop_replies(&self) {
        self.set_mode(ProxyMode::DropReplies);
    }

    /// Forwards again.
    pub fn restore(&self) {
        self.set_mode(ProxyMode::Pass);
    }

    /// Sets the mode directly.
    pub fn set_mode(&self, mode: ProxyMode) {
        self.settings.send_modify(|s| s.mode = mode);
    }

    /// The current mode.
    pub fn mode(&self) -> ProxyMode {
        self.settings.borrow().mode
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.set_mode(ProxyMode::Reset);
        self.task.abort();
    }
}

async fn accept_loop(
    listener: TcpListener,
    upstream: SocketAddr,
    settings: watch::Receiver<Settings>,
) {
    while let Ok((client, _)) = listener.accept().await {
        if settings.borrow().mode == ProxyMode::Reset {
            drop(client);
            continue;
        }
        let settings = settings.clone();
        tokio::spawn(async move {
            let Ok(server) = TcpStream::connect(upstream).await else {
                return;
            };
            let _ = client.set_nodelay(true);
            let _ = server.set_nodelay(true);
            let (cr, cw) = client.into_split();
            let (sr, sw) = server.into_split();
            // When one direction ends, the other is dropped: both sockets close.
            tokio::select! {
                _ = pump(cr, sw, settings.clone(), Direction::ToServer) => {}
                _ = pump(sr, cw, settings, Direction::ToClient) => {}
            }
        });
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut settings: watch::Receiver<Settings>,
    direction: Direction,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = tokio::select! {
            r = from.read(&mut buf) => match r {
                Ok(0) | Err(_) => {
                    // A close crosses a partition no sooner than data does.
                    hold_while_partitioned(&mut settings, direction).await;
                    return;
                }
                Ok(n) => n,
            },
            r = wait_for_reset(&mut settings) => { let () = r; return; }
        };
        // Hold the chunk while black-holed; drop the connection on reset.
        loop {
            let s = *settings.borrow_and_update();
            let held = match s.mode {
                ProxyMode::Reset => return,
                ProxyMode::Blackhole => true,
                ProxyMode::DropReplies => direction == Direction::ToClient,
                ProxyMode::Pass => false,
            };
            match held {
                false => {
                    if !s.latency.is_zero() {
                        tokio::time::sleep(s.latency).await;
                    }
                    break;
                }
                true => {
                    if settings.changed().await.is_err() {
                        return;
                    }
                }
            }
        }
        if settings.borrow().mode == ProxyMode::Reset {
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// Returns once traffic in `direction` flows again (or the proxy resets).
async fn hold_while_partitioned(settings: &mut watch::Receiver<Settings>, direction: Direction) {
    loop {
        let held = match settings.borrow_and_update().mode {
            ProxyMode::Blackhole => true,
            ProxyMode::DropReplies => direction == Direction::ToClient,
            ProxyMode::Pass | ProxyMode::Reset => false,
        };
        if !held || settings.changed().await.is_err() {
            return;
        }
    }
}

async fn wait_for_reset(settings: &mut watch::Receiver<Settings>) {
    loop {
        if settings.borrow_and_update().mode == ProxyMode::Reset {
            return;
        }
        if settings.changed().await.is_err() {
            return;
        }
    }
}
