//! The resource the clients write to: a linearizable register, run by the
//! tool itself (never by the backend under test), that accepts a write only
//! with a token at least as large as any it accepted — and an equal token only
//! from the hold that set it.
//!
//! Protocol, one line each way over TCP: `W KEY TOKEN|- HOLD` → `ok` or `no`.
//! A write without a token (a backend that gives none) is always accepted:
//! nothing can fence it, and the checker counts the damage.

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};

use fencelock::Hold;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// One write the register saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Write {
    /// When it was decided, in nanoseconds of the shared clock.
    pub at_ns: u128,
    /// The key (one register per key).
    pub key: String,
    /// The token it came with.
    pub token: Option<u64>,
    /// The hold that sent it.
    pub hold: String,
    /// Whether the register took it.
    pub accepted: bool,
}

#[derive(Default)]
struct State {
    /// Per key: the largest accepted token and the hold that wrote it.
    high: HashMap<String, (u64, String)>,
    writes: Vec<Write>,
}

impl State {
    fn decide(&mut self, key: &str, token: Option<u64>, hold: &str) -> bool {
        let accepted = match token {
            None => true,
            Some(t) => match self.high.get(key) {
                Some((high, by)) => t > *high || (t == *high && by == hold),
                None => true,
            },
        };
        if accepted && let Some(t) = token {
            self.high.insert(key.to_string(), (t, hold.to_string()));
        }
        self.writes.push(Write {
            at_ns: Hold::now_ns(),
            key: key.to_string(),
            token,
            hold: hold.to_string(),
            accepted,
        });
        accepted
    }
}

/// The register server on a loopback port.
pub struct Register {
    addr: SocketAddr,
    state: Arc<Mutex<State>>,
    task: JoinHandle<()>,
}

impl Register {
    /// Starts serving on a free loopback port.
    ///
    /// # Errors
    ///
    /// If no loopback port can be bound.
    pub async fn start() -> io::Result<Register> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let state = Arc::new(Mutex::new(State::default()));
        let shared = state.clone();
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(serve(stream, shared.clone()));
            }
        });
        Ok(Register { addr, state, task })
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Every write so far, in the order decided.
    pub fn writes(&self) -> Vec<Write> {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .writes
            .clone()
    }
}

impl Drop for Register {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve(stream: TcpStream, state: Arc<Mutex<State>>) {
    let _ = stream.set_nodelay(true);
    let (r, mut w) = stream.into_split();
    let mut lines = BufReader::new(r).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        let mut parts = line.split_whitespace();
        let reply: &[u8] = match (parts.next(), parts.next(), parts.next(), parts.next()) {
            (Some("W"), Some(key), Some(token), Some(hold)) => {
                let token = if token == "-" {
                    None
                } else {
                    token.parse().ok()
                };
                let ok = state
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .decide(key, token, hold);
                if ok { b"ok\n" } else { b"no\n" }
            }
            _ => b"bad\n",
        };
        if w.write_all(reply).await.is_err() {
            return;
        }
    }
}

/// A client's connection to the register.
pub struct RegisterClient {
    lines: tokio::io::Lines<BufReader<tokio::net::tcp::OwnedReadHalf>>,
    w: tokio::net::tcp::OwnedWriteHalf,
}

impl RegisterClient {
    /// Connects to the register at `addr`.
    ///
    /// # Errors
    ///
    /// If the connection fails.
    pub async fn connect(addr: SocketAddr) -> io::Result<RegisterClient> {
        let s = TcpStream::connect(addr).await?;
        s.set_nodelay(true)?;
        let (r, w) = s.into_split();
        Ok(RegisterClient {
            lines: BufReader::new(r).lines(),
            w,
        })
    }

    /// Writes to `key` with `token` as `hold`; whether the register took it.
    ///
    /// # Errors
    ///
    /// If the connection breaks.
    pub async fn write(&mut self, key: &str, token: Option<u64>, hold: &str) -> io::Result<bool> {
        let t = token.map_or("-".to_string(), |t| t.to_string());
        self.w
            .write_all(format!("W {key} {t} {hold}\n").as_bytes())
            .await?;
        match self.lines.next_line().await? {
            Some(l) => Ok(l == "ok"),
            None => Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "register closed",
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_only_rising_tokens_and_an_equal_one_from_its_hold() {
        let mut s = State::default();
        assert!(s.decide("k", Some(5), "a#1"));
        assert!(s.decide("k", Some(5), "a#1"));
        assert!(!s.decide("k", Some(5), "b#1"), "same token, other hold");
        assert!(!s.decide("k", Some(4), "c#1"), "older token");
        assert!(s.decide("k", Some(6), "b#2"));
        assert!(!s.decide("k", Some(5), "a#1"), "a's hold was superseded");
        assert!(s.decide("other", Some(1), "a#2"), "keys are separate");
        assert!(s.decide("k", None, "m#1") && s.decide("k", None, "n#1"));
        assert_eq!(s.writes.iter().filter(|w| !w.accepted).count(), 3);
    }
}
