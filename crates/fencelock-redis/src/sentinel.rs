//! The master of a service that Redis Sentinels monitor, found through the
//! Sentinels and followed through failovers.
//!
//! Every Sentinel that answers is asked (`SENTINEL MASTER`), and the newest
//! configuration wins (the highest `config-epoch`: a Sentinel that has not yet
//! heard of a failover names the old master with an older epoch). A master
//! that is objectively down or being replaced (`o_down`,
//! `failover_in_progress`) is not used; once a replica has taken its place,
//! the Sentinel that runs the failover names it (`GET-MASTER-ADDR-BY-NAME`)
//! and it is used, while the other replicas still copy from it. A connection
//! is used only once the server itself answers `ROLE` with `master`.
//!
//! The connection is dropped, and the next command asks the Sentinels again,
//! when a command fails as commands fail in a failover (the connection drops
//! or times out; `READONLY`: the server was turned into a replica;
//! `NOREPLICAS`, `MASTERDOWN`) and when the once-a-second check finds that the
//! Sentinels name another master or are replacing this one (a master cut off
//! from the Sentinels but not from this client answers on). So a client never
//! writes to a replica, and stops writing to an old master within about a
//! second of the Sentinels' switch. Channels are subscribed again on the new
//! master, and every waiter is woken to re-check (messages may be lost).

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::{
    AsyncConnectionConfig, Client, Cmd, ConnectionAddr, ErrorKind, FromRedisValue,
    IntoConnectionInfo, PushInfo, PushKind, RedisConnectionInfo, RedisError, RedisResult, Value,
};
use tokio::sync::mpsc::UnboundedSender;

/// How often the Sentinels are asked whether the master changed.
const CHECK_EVERY: Duration = Duration::from_secs(1);

/// The longest one Sentinel may take to answer a lookup.
const SENTINEL_PATIENCE: Duration = Duration::from_secs(1);

/// A failover-following connection to the master of one service.
pub(crate) struct Master {
    /// One client per Sentinel, with the Sentinels' login.
    sentinels: Vec<Client>,
    /// Their connections, made when first needed, dropped on an error.
    asked: tokio::sync::Mutex<Vec<Option<MultiplexedConnection>>>,
    /// The data nodes' login and database.
    node: RedisConnectionInfo,
    /// One connect at a time (one that finds the master serves every
    /// command that waited for it).
    connecting: tokio::sync::Mutex<()>,
    current: Mutex<Option<Current>>,
    config: AsyncConnectionConfig,
    push: UnboundedSender<PushInfo>,
    /// Channels to subscribe again on a new master.
    channels: Mutex<BTreeSet<String>>,
    connect_timeout: Duration,
    service: String,
    /// Connections made so far.
    made: AtomicU64,
}

#[derive(Clone)]
struct Current {
    conn: MultiplexedConnection,
    /// Where it goes.
    addr: (String, u16),
    /// Counts connections made, so that a failure on an old one does not
    /// drop a newer one.
    id: u64,
}

/// What the Sentinels say of the service.
#[derive(Debug, PartialEq, Eq)]
enum Named {
    /// The master of the newest configuration, up and not being replaced.
    Master(String, u16),
    /// A master is down or being replaced: wait.
    NoneUp,
    /// Every Sentinel that answered monitors no such service.
    NoSuchService,
    /// Every Sentinel refused the lookup (not a Sentinel, a refused login):
    /// what each said.
    Refused(String),
    /// No Sentinel answered: why, per Sentinel.
    Silent(String),
}

/// Whether `e` is a server's refusal rather than a missing answer.
fn is_refusal(e: &RedisError) -> bool {
    !(e.is_io_error() || e.is_connection_refusal() || e.is_connection_dropped() || e.is_timeout())
}

/// Whether `e` says that this connection may no longer reach the master.
fn lost_master(e: &RedisError) -> bool {
    e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_timeout()
        || matches!(
            e.code(),
            Some("READONLY" | "MASTERDOWN" | "NOREPLICAS" | "LOADING")
        )
        // A script's write refused on a replica.
        || e.to_string().contains("READONLY")
}

/// A `SENTINEL MASTER` reply as field → value.
pub(crate) fn fields(v: &Value) -> HashMap<String, String> {
    let text = |v: &Value| match v {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        Value::Int(i) => Some(i.to_string()),
        _ => None,
    };
    let mut out = HashMap::new();
    match v {
        Value::Array(items) => {
            for pair in items.chunks(2) {
                if let [k, v] = pair
                    && let (Some(k), Some(v)) = (text(k), text(v))
                {
                    out.insert(k, v);
                }
            }
        }
        Value::Map(pairs) => {
            for (k, v) in pairs {
                if let (Some(k), Some(v)) = (text(k), text(v)) {
                    out.insert(k, v);
                }
            }
        }
        _ => {}
    }
    out
}

impl Master {
    /// A master to be found through `sentinels` (each with its login);
    /// `node` is the data nodes' login and database.
    pub(crate) fn new(
        sentinels: Vec<Client>,
        node: RedisConnectionInfo,
        config: AsyncConnectionConfig,
        push: UnboundedSender<PushInfo>,
        connect_timeout: Duration,
        service: String,
    ) -> Arc<Master> {
        let asked = tokio::sync::Mutex::new(vec![None; sentinels.len()]);
        let master = Arc::new(Master {
            sentinels,
            asked,
            node,
            connecting: tokio::sync::Mutex::new(()),
            current: Mutex::new(None),
            config,
            push,
            channels: Mutex::new(BTreeSet::new()),
            connect_timeout,
            service,
            made: AtomicU64::new(0),
        });
        tokio::spawn(watch(Arc::downgrade(&master)));
        master
    }

    /// Asks every Sentinel at once; the newest configuration wins.
    async fn named(&self) -> Named {
        let mut asked = self.asked.lock().await;
        let answers = futures::future::join_all(self.sentinels.iter().zip(asked.iter_mut()).map(
            |(client, conn)| async move {
                let ask = async {
                    if conn.is_none() {
                        *conn = Some(client.get_multiplexed_async_connection().await?);
                    }
                    let c = conn.as_mut().expect("made above");
                    redis::pipe()
                        .cmd("SENTINEL")
                        .arg("MASTER")
                        .arg(&self.service)
                        .cmd("SENTINEL")
                        .arg("GET-MASTER-ADDR-BY-NAME")
                        .arg(&self.service)
                        .query_async::<(Value, Option<(String, u16)>)>(c)
                        .await
                };
                let answer = tokio::time::timeout(SENTINEL_PATIENCE, ask).await;
                if !matches!(answer, Ok(Ok(_))) {
                    *conn = None;
                }
                answer
            },
        ))
        .await;
        drop(asked);
        let (mut unknown, mut answered) = (0, 0);
        let (mut refusals, mut silences) = (Vec::new(), Vec::new());
        let mut best: Option<(u64, Option<(String, u16)>)> = None;
        for (answer, client) in answers.into_iter().zip(&self.sentinels) {
            let at = client.get_connection_info().addr();
            let (v, current) = match answer {
                Ok(Ok(v)) => v,
                Ok(Err(e)) if e.to_string().contains("No such master") => {
                    answered += 1;
                    unknown += 1;
                    continue;
                }
                Ok(Err(e)) if is_refusal(&e) => {
                    refusals.push(format!("{at}: {e}"));
                    continue;
                }
                Ok(Err(e)) => {
                    silences.push(format!("{at}: {e}"));
                    continue;
                }
                Err(_) => {
                    silences.push(format!(
                        "{at}: no answer within {}",
                        humantime::format_duration(SENTINEL_PATIENCE)
                    ));
                    continue;
                }
            };
            answered += 1;
            let f = fields(&v);
            let epoch = f
                .get("config-epoch")
                .and_then(|e| e.parse().ok())
                .unwrap_or(0);
            let flags = f.get("flags").map_or("", String::as_str);
            let failing_over = flags.contains("failover_in_progress");
            let usable = flags.contains("master") && !flags.contains("o_down") && !failing_over;
            let named = match (f.get("ip"), f.get("port").and_then(|p| p.parse().ok())) {
                (Some(ip), Some(port)) => Some((ip.clone(), port)),
                _ => None,
            };
            let addr = match current {
                // The Sentinel that runs a failover names the promoted replica
                // once it took the role (its entry, at the new epoch, still
                // names the old master until the other replicas follow).
                Some(promoted) if failing_over && named.as_ref() != Some(&promoted) => {
                    Some(promoted)
                }
                _ => named.filter(|_| usable),
            };
            // The newest configuration; at one epoch, one that says the
            // master is down or being replaced counts over one that does not.
            if best
                .as_ref()
                .is_none_or(|(e, a)| epoch > *e || epoch == *e && a.is_some() && addr.is_none())
            {
                best = Some((epoch, addr));
            }
        }
        match best {
            Some((_, Some((ip, port)))) => Named::Master(ip, port),
            Some((_, None)) => Named::NoneUp,
            None if answered > 0 && unknown == answered => Named::NoSuchService,
            None if silences.is_empty() && !refusals.is_empty() => {
                Named::Refused(refusals.join("; "))
            }
            None => {
                silences.extend(refusals);
                Named::Silent(silences.join("; "))
            }
        }
    }

    /// Fails with a configuration error if the Sentinels that answer
    /// monitor no service of this name.
    pub(crate) async fn check_service(&self) -> Result<(), String> {
        match self.named().await {
            Named::NoSuchService => Err(format!(
                "the Sentinels monitor no service named {:?} (the path of a redis+sentinel:// URL names it)",
                self.service
            )),
            Named::Refused(why) => Err(format!(
                "no Sentinel takes the lookup ({why}): the hosts of a redis+sentinel:// URL are the Sentinels, and sentinel_user=/sentinel_password= their login"
            )),
            _ => Ok(()),
        }
    }

    fn current(&self) -> Option<Current> {
        self.current
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The connection to the master, made if there is none.
    async fn conn(&self) -> RedisResult<Current> {
        if let Some(c) = self.current() {
            return Ok(c);
        }
        let _one = self.connecting.lock().await;
        if let Some(c) = self.current() {
            return Ok(c);
        }
        let c = tokio::time::timeout(self.connect_timeout, self.connect())
            .await
            .map_err(|_| {
                RedisError::from((
                    ErrorKind::Io,
                    "no master found through the Sentinels within connect_timeout",
                ))
            })??;
        *self.current.lock().unwrap_or_else(|p| p.into_inner()) = Some(c.clone());
        // Messages may have been lost on the way: every waiter re-checks.
        let _ = self.push.send(PushInfo {
            kind: PushKind::Disconnection,
            data: Vec::new(),
        });
        Ok(c)
    }

    /// Asks the Sentinels for the master, connects, checks that the server
    /// is the master, and subscribes the channels again.
    async fn connect(&self) -> RedisResult<Current> {
        let (host, port) = match self.named().await {
            Named::Master(host, port) => (host, port),
            Named::NoSuchService => {
                return Err(RedisError::from((
                    ErrorKind::Io,
                    "the Sentinels monitor no such service",
                    self.service.clone(),
                )));
            }
            Named::NoneUp => {
                return Err(RedisError::from((
                    ErrorKind::Io,
                    "the Sentinels name no master that is up (it is down or being replaced)",
                    format!("service {:?}", self.service),
                )));
            }
            Named::Refused(why) => {
                return Err(RedisError::from((
                    ErrorKind::Io,
                    "no Sentinel takes the lookup",
                    format!("service {:?}: {why}", self.service),
                )));
            }
            Named::Silent(why) => {
                return Err(RedisError::from((
                    ErrorKind::Io,
                    "no Sentinel answers",
                    format!("service {:?}: {why}", self.service),
                )));
            }
        };
        let info = ConnectionAddr::Tcp(host.clone(), port)
            .into_connection_info()?
            .set_redis_settings(self.node.clone());
        let mut conn = Client::open(info)?
            .get_multiplexed_async_connection_with_config(&self.config)
            .await?;
        let role: Value = redis::cmd("ROLE").query_async(&mut conn).await?;
        let is_master = matches!(&role, Value::Array(v) if v.first().is_some_and(|r| {
            matches!(r, Value::BulkString(b) if b == b"master")
                || matches!(r, Value::SimpleString(s) if s == "master")
        }));
        if !is_master {
            return Err(RedisError::from((
                ErrorKind::Io,
                "the server the Sentinels name as master is not (yet) a master",
                format!("{host}:{port}, service {:?}", self.service),
            )));
        }
        let channels: Vec<String> = self
            .channels
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .cloned()
            .collect();
        for ch in channels {
            conn.subscribe(&ch).await?;
        }
        Ok(Current {
            conn,
            addr: (host, port),
            id: self.made.fetch_add(1, Ordering::Relaxed),
        })
    }

    /// Drops connection `id` (if it is still the current one).
    fn forget(&self, id: u64) {
        let mut current = self.current.lock().unwrap_or_else(|p| p.into_inner());
        if current.as_ref().is_some_and(|c| c.id == id) {
            *current = None;
        }
    }

    /// Runs `cmd` on the master.
    pub(crate) async fn query<T: FromRedisValue>(&self, cmd: &Cmd) -> RedisResult<T> {
        let mut c = self.conn().await?;
        let r = cmd.query_async(&mut c.conn).await;
        if let Err(e) = &r
            && lost_master(e)
        {
            self.forget(c.id);
        }
        r
    }

    pub(crate) async fn subscribe(&self, channel: &str) -> RedisResult<()> {
        // Recorded first: a new master found meanwhile subscribes it too.
        self.channels
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(channel.to_string());
        let mut c = self.conn().await?;
        let r = c.conn.subscribe(channel).await;
        if let Err(e) = &r
            && lost_master(e)
        {
            self.forget(c.id);
        }
        r
    }

    pub(crate) async fn unsubscribe(&self, channel: &str) -> RedisResult<()> {
        self.channels
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(channel);
        let mut c = self.conn().await?;
        c.conn.unsubscribe(channel).await
    }
}

/// Once a second, while the master is in use: drops the connection if the
/// Sentinels name another master or are replacing this one.
async fn watch(master: Weak<Master>) {
    let mut tick = tokio::time::interval(CHECK_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(m) = master.upgrade() else { return };
        let Some(c) = m.current() else { continue };
        let stale = match m.named().await {
            Named::Master(host, port) => (host, port) != c.addr,
            Named::NoneUp => true,
            // Nobody to ask, or a changed configuration: keep what works.
            Named::NoSuchService | Named::Refused(_) | Named::Silent(_) => false,
        };
        if stale {
            tracing::debug!(service = %m.service, "the Sentinels replace the master; connecting anew");
            m.forget(c.id);
        }
    }
}
