//! A failover drill on a Sentinel setup: the master's replicas are cut off,
//! then the Sentinels promote one of them. What the master accepted in
//! between is lost, as when a master dies before its replicas copied a
//! write. `fencelock demo` shows with it what a fencing token does after
//! such a failover.
//!
//! Run it only against a setup you may break: writes made to the master while
//! its replicas are cut off are lost, and the service ends up with another
//! master. The cut sets each replica's `masterauth` to a value the master
//! refuses and closes the replicas' links (`CLIENT KILL TYPE replica`);
//! [`Drill::restore`] puts `masterauth` back (and rewrites the config file,
//! as the Sentinels rewrite it during a failover). The replicas need
//! `CONFIG` and the master `CLIENT KILL`. A process killed before the restore
//! leaves `masterauth` at `fencelock-drill-…` (also in the config files the
//! Sentinels rewrote): the next [`Drill::cut`] refuses to start and names the
//! nodes, whose `masterauth` must then be set back by hand.

use std::time::Duration;

use fencelock_core::{Error, Result};
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, Client, IntoConnectionInfo, RedisConnectionInfo, Value};

use crate::node::NAME;
use crate::options::{Target, parse_url};
use crate::sentinel::fields;

/// How the `masterauth` of a cut replica begins.
const MARK: &str = "fencelock-drill-";

/// The longest one command of the drill may take.
const PATIENCE: Duration = Duration::from_secs(5);

/// A master cut off from its replicas; see the [module docs](self).
pub struct Drill {
    service: String,
    sentinels: Vec<Client>,
    node: RedisConnectionInfo,
    master: (String, u16),
    /// Each replica cut off, with its own `masterauth`.
    cut: Vec<((String, u16), Option<String>)>,
}

fn addr(a: &(String, u16)) -> String {
    format!("{}:{}", a.0, a.1)
}

impl Drill {
    /// Cuts the master of the `redis+sentinel://` service `url` names off
    /// from its replicas. Fails if the Sentinels know no replica that is up,
    /// or if a replica's link stays up.
    pub async fn cut(url: &str) -> Result<Drill> {
        let (Target::Sentinel(t), _) = parse_url(url)? else {
            return Err(Error::config(
                "a failover drill needs a redis+sentinel:// URL",
            ));
        };
        let (sentinels, node) = crate::conn::sentinel_logins(&t)?;
        let mut drill = Drill {
            service: t.service,
            sentinels,
            node,
            master: (String::new(), 0),
            cut: Vec::new(),
        };
        drill.master = drill.named_master().await?;
        drill.check_master_takes_writes_alone().await?;
        let replicas = drill.replicas_up().await?;
        drill.check_no_leftovers(&replicas).await?;
        if replicas.is_empty() {
            return Err(Error::backend(
                NAME,
                format!(
                    "the Sentinels know no replica of {:?} that is up: there is nothing to fail over to",
                    drill.service
                ),
            ));
        }
        if let Err(e) = drill.cut_off(replicas).await {
            drill.put_back().await;
            return Err(e);
        }
        Ok(drill)
    }

    /// The master cut off, as `host:port`.
    pub fn master(&self) -> String {
        addr(&self.master)
    }

    /// How many replicas were cut off.
    pub fn replicas(&self) -> usize {
        self.cut.len()
    }

    /// Asks the Sentinels to promote a replica and waits, up to `within`, until
    /// they name it as the master. Returns its address, `host:port`.
    pub async fn fail_over(&self, within: Duration) -> Result<String> {
        let mut asked = None;
        for s in &self.sentinels {
            let reply = self
                .ask::<Value>(s, redis::cmd("SENTINEL").arg("FAILOVER").arg(&self.service))
                .await;
            match reply {
                Ok(_) => {
                    asked = Some(());
                    break;
                }
                Err(e) if e.to_string().contains("INPROG") => {
                    asked = Some(());
                    break;
                }
                Err(e) if e.to_string().contains("NOGOODSLAVE") => {
                    return Err(Error::backend(
                        NAME,
                        "the Sentinels found no replica fit to promote (NOGOODSLAVE)",
                    ));
                }
                Err(_) => {}
            }
        }
        if asked.is_none() {
            return Err(Error::connection(
                NAME,
                &self.service,
                "no Sentinel took the failover request",
            ));
        }
        let deadline = tokio::time::Instant::now() + within;
        loop {
            if let Ok(m) = self.named_master().await
                && m != self.master
                && self.role(&m).await.as_deref() == Some("master")
            {
                return Ok(addr(&m));
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(Error::backend(
                    NAME,
                    format!(
                        "the Sentinels named no new master of {:?} within {} (their logs say why: a Sentinel in TILT mode, or replicas cut off for longer than 10 × down-after-milliseconds, abort a failover)",
                        self.service,
                        humantime::format_duration(within)
                    ),
                ));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Lets the replicas copy from their master again. Fails, after trying
    /// every replica, if one could not be reached (set its `masterauth` by
    /// hand then).
    pub async fn restore(mut self) -> Result<()> {
        let failed = self.put_back().await;
        if failed.is_empty() {
            Ok(())
        } else {
            Err(Error::backend(
                NAME,
                format!(
                    "could not put masterauth back on {}: set it by hand",
                    failed.join(", ")
                ),
            ))
        }
    }

    async fn cut_off(&mut self, replicas: Vec<(String, u16)>) -> Result<()> {
        let refused = format!("{MARK}{:016x}", fastrand::u64(..));
        for r in replicas {
            let mut c = self.node(&r).await?;
            let got: Value = timed(
                redis::cmd("CONFIG")
                    .arg("GET")
                    .arg("masterauth")
                    .query_async(&mut c),
            )
            .await
            .map_err(|e| self.refused(&r, "CONFIG GET masterauth", e))?;
            let own = fields(&got).remove("masterauth").filter(|v| !v.is_empty());
            timed(
                redis::cmd("CONFIG")
                    .arg("SET")
                    .arg("masterauth")
                    .arg(&refused)
                    .query_async::<()>(&mut c),
            )
            .await
            .map_err(|e| self.refused(&r, "CONFIG SET masterauth", e))?;
            self.cut.push((r, own));
        }
        let master = self.master.clone();
        let mut m = self.node(&master).await?;
        timed(
            redis::cmd("CLIENT")
                .arg("KILL")
                .arg("TYPE")
                .arg("replica")
                .query_async::<Value>(&mut m),
        )
        .await
        .map_err(|e| self.refused(&master, "CLIENT KILL TYPE replica", e))?;
        // A replica that was reconnecting when its masterauth changed may
        // still finish its handshake: kill again until none is linked.
        let deadline = tokio::time::Instant::now() + PATIENCE;
        loop {
            let info: String = timed(redis::cmd("INFO").arg("replication").query_async(&mut m))
                .await
                .map_err(|e| self.refused(&master, "INFO replication", e))?;
            if info.contains("connected_slaves:0") {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(Error::backend(
                    NAME,
                    format!("the replicas of {} stayed linked", addr(&master)),
                ));
            }
            let _ = timed(
                redis::cmd("CLIENT")
                    .arg("KILL")
                    .arg("TYPE")
                    .arg("replica")
                    .query_async::<Value>(&mut m),
            )
            .await;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Fails if the master refuses writes while too few replicas copy them
    /// (`min-replicas-to-write`): it would refuse the grant the drill means
    /// to lose.
    async fn check_master_takes_writes_alone(&self) -> Result<()> {
        let master = self.master.clone();
        let mut m = self.node(&master).await?;
        let got: Value = timed(
            redis::cmd("CONFIG")
                .arg("GET")
                .arg("min-replicas-to-write")
                .query_async(&mut m),
        )
        .await
        .map_err(|e| self.refused(&master, "CONFIG GET min-replicas-to-write", e))?;
        let min: u32 = fields(&got)
            .get("min-replicas-to-write")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        if min > 0 {
            return Err(Error::backend(
                NAME,
                format!(
                    "{} refuses writes while fewer than {min} replicas copy them (min-replicas-to-write): it cannot grant what a failover would lose",
                    addr(&master)
                ),
            ));
        }
        Ok(())
    }

    /// Fails if a node still has the `masterauth` of a drill that was killed.
    async fn check_no_leftovers(&self, replicas: &[(String, u16)]) -> Result<()> {
        let mut left = Vec::new();
        for n in std::iter::once(&self.master).chain(replicas) {
            let mut c = self.node(n).await?;
            let got: Value = timed(
                redis::cmd("CONFIG")
                    .arg("GET")
                    .arg("masterauth")
                    .query_async(&mut c),
            )
            .await
            .map_err(|e| self.refused(n, "CONFIG GET masterauth", e))?;
            if fields(&got)
                .get("masterauth")
                .is_some_and(|v| v.starts_with(MARK))
            {
                left.push(addr(n));
            }
        }
        if left.is_empty() {
            return Ok(());
        }
        Err(Error::backend(
            NAME,
            format!(
                "a drill that was killed left masterauth at {MARK}… on {}: set it back there (CONFIG SET masterauth <what it was>; CONFIG REWRITE)",
                left.join(", ")
            ),
        ))
    }

    /// Puts each replica's `masterauth` back; returns those it could not reach.
    async fn put_back(&mut self) -> Vec<String> {
        let mut failed = Vec::new();
        for (r, own) in std::mem::take(&mut self.cut) {
            let done = async {
                let mut c = self.node(&r).await.ok()?;
                timed(
                    redis::cmd("CONFIG")
                        .arg("SET")
                        .arg("masterauth")
                        .arg(own.as_deref().unwrap_or(""))
                        .query_async::<()>(&mut c),
                )
                .await
                .ok()?;
                // A server started without a config file refuses; that is fine.
                let _ = timed(
                    redis::cmd("CONFIG")
                        .arg("REWRITE")
                        .query_async::<()>(&mut c),
                )
                .await;
                Some(())
            };
            if done.await.is_none() {
                failed.push(addr(&r));
            }
        }
        failed
    }

    /// The master the first Sentinel that answers names.
    async fn named_master(&self) -> Result<(String, u16)> {
        for s in &self.sentinels {
            let reply: Result<Option<(String, u16)>> = self
                .ask(
                    s,
                    redis::cmd("SENTINEL")
                        .arg("GET-MASTER-ADDR-BY-NAME")
                        .arg(&self.service),
                )
                .await;
            match reply {
                Ok(Some(m)) => return Ok(m),
                Ok(None) => {
                    return Err(Error::config(format!(
                        "the Sentinels monitor no service named {:?}",
                        self.service
                    )));
                }
                Err(_) => {}
            }
        }
        Err(Error::connection(
            NAME,
            &self.service,
            "no Sentinel answered",
        ))
    }

    /// The replicas the first Sentinel that answers knows and thinks up.
    async fn replicas_up(&self) -> Result<Vec<(String, u16)>> {
        for s in &self.sentinels {
            let Ok(list) = self
                .ask::<Vec<Value>>(s, redis::cmd("SENTINEL").arg("REPLICAS").arg(&self.service))
                .await
            else {
                continue;
            };
            return Ok(list
                .iter()
                .map(fields)
                .filter(|f| {
                    let flags = f.get("flags").map_or("", String::as_str);
                    !flags.contains("s_down") && !flags.contains("disconnected")
                })
                .filter_map(|f| Some((f.get("ip")?.clone(), f.get("port")?.parse().ok()?)))
                .collect());
        }
        Err(Error::connection(
            NAME,
            &self.service,
            "no Sentinel answered",
        ))
    }

    /// What `ROLE` says on the node at `a`.
    async fn role(&self, a: &(String, u16)) -> Option<String> {
        let mut c = self.node(a).await.ok()?;
        let v: Vec<Value> = timed(redis::cmd("ROLE").query_async(&mut c)).await.ok()?;
        redis::from_redis_value(v.first()?.clone()).ok()
    }

    async fn ask<T: redis::FromRedisValue>(&self, s: &Client, cmd: &mut redis::Cmd) -> Result<T> {
        let addr = s.get_connection_info().addr().to_string();
        let err = |e: redis::RedisError| Error::connection(NAME, &addr, e);
        let mut c = timed(s.get_multiplexed_async_connection_with_config(&config()))
            .await
            .map_err(err)?;
        timed(cmd.query_async(&mut c)).await.map_err(err)
    }

    async fn node(&self, a: &(String, u16)) -> Result<MultiplexedConnection> {
        let err = |e: redis::RedisError| Error::connection(NAME, &addr(a), e);
        let info = redis::ConnectionAddr::Tcp(a.0.clone(), a.1)
            .into_connection_info()
            .map_err(err)?
            .set_redis_settings(self.node.clone());
        let client = Client::open(info).map_err(err)?;
        timed(client.get_multiplexed_async_connection_with_config(&config()))
            .await
            .map_err(err)
    }

    fn refused(&self, a: &(String, u16), what: &str, e: redis::RedisError) -> Error {
        Error::backend(NAME, format!("{} refused {what}: {e}", addr(a)))
    }
}

fn config() -> AsyncConnectionConfig {
    AsyncConnectionConfig::new()
        .set_connection_timeout(Some(PATIENCE))
        .set_response_timeout(Some(PATIENCE))
}

/// `f`, or a timeout error after [`PATIENCE`].
async fn timed<T>(
    f: impl std::future::Future<Output = redis::RedisResult<T>>,
) -> redis::RedisResult<T> {
    tokio::time::timeout(PATIENCE, f).await.unwrap_or_else(|_| {
        Err(redis::RedisError::from((
            redis::ErrorKind::Io,
            "no answer within 5 s",
        )))
    })
}
