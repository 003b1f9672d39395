//! The master of a service that Redis Sentinels monitor, found through the
//! Sentinels and followed through failovers.
//!
//! A connection is made only to the address the Sentinels name as the master,
//! and used only once the server itself answers `ROLE` with `master`. A
//! command that fails as a failover makes commands fail (the connection drops
//! or times out, the server says `READONLY`: it was turned into a replica)
//! drops the connection; the next command asks the Sentinels again. So a
//! client never writes to a replica, and never goes back to an old master
//! that the Sentinels no longer name. Channels subscribed are subscribed again
//! on the new master, and every waiter is woken to re-check (messages may be
//! lost in between).

use std::collections::BTreeSet;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::sentinel::SentinelClient;
use redis::{
    AsyncConnectionConfig, Cmd, ErrorKind, FromRedisValue, PushInfo, PushKind, RedisError,
    RedisResult, Value,
};
use tokio::sync::mpsc::UnboundedSender;

/// A failover-following connection to the master of one service.
pub(crate) struct Master {
    /// The Sentinels; one lookup at a time (a lookup that finds a master
    /// serves every command that waited for it).
    lookup: tokio::sync::Mutex<SentinelClient>,
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
    /// Counts connections made, so that a failure on an old one does not
    /// drop a newer one.
    id: u64,
}

/// Whether `e` says that this connection may no longer reach the master.
fn lost_master(e: &RedisError) -> bool {
    e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_timeout()
        || matches!(e.code(), Some("READONLY" | "MASTERDOWN" | "LOADING"))
        || e.to_string().contains("READONLY")
}

impl Master {
    pub(crate) fn new(
        lookup: SentinelClient,
        config: AsyncConnectionConfig,
        push: UnboundedSender<PushInfo>,
        connect_timeout: Duration,
        service: String,
    ) -> Master {
        Master {
            lookup: tokio::sync::Mutex::new(lookup),
            current: Mutex::new(None),
            config,
            push,
            channels: Mutex::new(BTreeSet::new()),
            connect_timeout,
            service,
            made: AtomicU64::new(0),
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
        let mut lookup = self.lookup.lock().await;
        if let Some(c) = self.current() {
            return Ok(c);
        }
        // Boxed: the lookup's future is deep enough to overflow the type
        // checker's limits in every caller.
        let connect: std::pin::Pin<Box<dyn Future<Output = RedisResult<_>> + Send + '_>> =
            Box::pin(self.connect(&mut lookup));
        let conn = tokio::time::timeout(self.connect_timeout, connect)
            .await
            .map_err(|_| {
                RedisError::from((
                    ErrorKind::Io,
                    "no master found through the Sentinels within connect_timeout",
                ))
            })??;
        let mut current = self.current.lock().unwrap_or_else(|p| p.into_inner());
        let id = self.made.fetch_add(1, Ordering::Relaxed);
        let c = Current { conn, id };
        *current = Some(c.clone());
        drop(current);
        // Messages may have been lost on the way: every waiter re-checks.
        let _ = self.push.send(PushInfo {
            kind: PushKind::Disconnection,
            data: Vec::new(),
        });
        Ok(c)
    }

    /// Asks the Sentinels for the master, connects, checks that the server
    /// is the master, and subscribes the channels again.
    async fn connect(&self, lookup: &mut SentinelClient) -> RedisResult<MultiplexedConnection> {
        let client = lookup.async_get_client().await.map_err(|e| {
            if e.kind() == ErrorKind::MasterNameNotFoundBySentinel {
                // Also while the Sentinels see the master down, before they
                // promote a replica: worth waiting through.
                RedisError::from((
                    ErrorKind::Io,
                    "the Sentinels name no master that is up",
                    format!(
                        "service {:?}: a failover in progress, or no such service",
                        self.service
                    ),
                ))
            } else {
                e
            }
        })?;
        let mut conn = client
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
                format!("service {}", self.service),
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
        Ok(conn)
    }

    /// Fails with a configuration error if a Sentinel that answers monitors
    /// no service of this name (the lookup cannot tell that from a master
    /// that is down).
    pub(crate) async fn check_service(&self) -> Result<(), String> {
        let client = {
            let mut lookup = self.lookup.lock().await;
            let find: std::pin::Pin<
                Box<dyn Future<Output = RedisResult<redis::Client>> + Send + '_>,
            > = Box::pin(lookup.async_get_sentinel_client());
            match tokio::time::timeout(self.connect_timeout, find).await {
                Ok(Ok(c)) => c,
                // No Sentinel answers: the first command says so.
                _ => return Ok(()),
            }
        };
        let asked = async {
            let mut conn = client.get_multiplexed_async_connection().await?;
            redis::cmd("SENTINEL")
                .arg("MASTER")
                .arg(&self.service)
                .query_async::<Value>(&mut conn)
                .await
        };
        match tokio::time::timeout(self.connect_timeout, asked).await {
            Ok(Err(e)) if e.to_string().contains("No such master") => Err(format!(
                "the Sentinels monitor no service named {:?} (the path of a redis+sentinel:// URL names it)",
                self.service
            )),
            _ => Ok(()),
        }
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
