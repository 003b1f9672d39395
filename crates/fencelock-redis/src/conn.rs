//! One connection abstraction over a single Redis (a `ConnectionManager`, which
//! reconnects), a Redis Cluster (a cluster connection, which follows slots) and
//! the master of a Sentinel service (which follows failovers); all speak RESP3 so that pub/sub messages arrive on the same connection.

use std::sync::Arc;
use std::time::Duration;

use fencelock_core::backend::redact_url;
use fencelock_core::{Error, Result};
use redis::aio::ConnectionManager;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{
    MultipleNodeRoutingInfo, ResponsePolicy, Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr,
};
use redis::{
    Cmd, FromRedisValue, IntoConnectionInfo, ProtocolVersion, PushInfo, RedisError, Value,
};
use tokio::sync::mpsc::UnboundedSender;

use crate::node::NAME;
use crate::options::{RedisOptions, SentinelTarget, Target};
use crate::scripts::Call;
use crate::sentinel::Master;

#[derive(Clone)]
pub(crate) enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
    Sentinel(Arc<Master>),
}

/// Maps a client error: connection trouble (and refused credentials) names the
/// (redacted) address.
pub(crate) fn map_err(e: RedisError, addr: &str) -> Error {
    let auth = e.kind() == redis::ErrorKind::AuthenticationFailed
        || matches!(e.code(), Some("WRONGPASS" | "NOAUTH"));
    let err = if auth {
        Error::login_refused(NAME, addr, &e)
    } else if e.is_io_error()
        || e.is_connection_refusal()
        || e.is_connection_dropped()
        || e.is_timeout()
        // The server is loading its data after a restart, a cluster is
        // between states, or a master refuses writes until its replicas are
        // back (`min-replicas-to-write`): a retry cures it.
        || matches!(
            e.code(),
            Some("LOADING" | "TRYAGAIN" | "CLUSTERDOWN" | "MASTERDOWN" | "NOREPLICAS")
        )
    {
        Error::connection(NAME, addr, &e)
    } else {
        Error::backend(NAME, &e)
    };
    err.with_source(e)
}

/// Makes sure TLS can be used: with the `tls` feature, installs rustls's ring
/// provider as the process default (unless one is installed already).
#[cfg(feature = "tls")]
fn ensure_tls() -> Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    Ok(())
}

#[cfg(not(feature = "tls"))]
fn ensure_tls() -> Result<()> {
    Err(Error::config(
        "rediss:// needs TLS support: enable the cargo feature `tls` of fencelock-redis (`redis-tls` of fencelock and fencelock-cli)",
    ))
}

#[cfg(feature = "tls")]
fn certificates(ca: Vec<u8>) -> redis::TlsCertificates {
    redis::TlsCertificates {
        client_tls: None,
        root_cert: Some(ca),
    }
}

#[cfg(feature = "tls")]
fn client_with_ca(info: redis::ConnectionInfo, ca: Vec<u8>) -> redis::RedisResult<redis::Client> {
    redis::Client::build_with_tls(info, certificates(ca))
}

#[cfg(feature = "tls")]
fn cluster_with_ca(
    builder: redis::cluster::ClusterClientBuilder,
    ca: Option<Vec<u8>>,
) -> redis::cluster::ClusterClientBuilder {
    match ca {
        Some(ca) => builder.certs(certificates(ca)),
        None => builder,
    }
}

// Without TLS support `ensure_tls` refuses a CA before these are reached.
#[cfg(not(feature = "tls"))]
fn client_with_ca(info: redis::ConnectionInfo, _ca: Vec<u8>) -> redis::RedisResult<redis::Client> {
    redis::Client::open(info)
}

#[cfg(not(feature = "tls"))]
fn cluster_with_ca(
    builder: redis::cluster::ClusterClientBuilder,
    _ca: Option<Vec<u8>>,
) -> redis::cluster::ClusterClientBuilder {
    builder
}

fn is_noscript(e: &RedisError) -> bool {
    e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript)
        || e.code() == Some("NOSCRIPT")
}

impl Conn {
    /// Connects; pub/sub messages go to `push`.
    pub(crate) async fn open(
        target: &Target,
        options: &RedisOptions,
        push: UnboundedSender<PushInfo>,
        addr: &str,
    ) -> Result<Conn> {
        let err = |e: RedisError| map_err(e, addr);
        let tls = match target {
            Target::Single(url) => url.starts_with("rediss:"),
            Target::Cluster(nodes) => nodes.iter().any(|n| n.starts_with("rediss:")),
            Target::Sentinel(_) => false,
        };
        if tls || options.tls_ca.is_some() {
            ensure_tls()?;
        }
        let ca = match &options.tls_ca {
            Some(path) => Some(std::fs::read(path).map_err(|e| {
                Error::config(format!("redis option tls_ca={}: {e}", path.display()))
            })?),
            None => None,
        };
        match target {
            Target::Single(url) => {
                let info = url.as_str().into_connection_info().map_err(|e| {
                    Error::config(format!("bad redis URL {}: {e}", redact_url(url)))
                })?;
                let settings = info
                    .redis_settings()
                    .clone()
                    .set_protocol(ProtocolVersion::RESP3);
                let info = info.set_redis_settings(settings);
                let client = match ca {
                    Some(ca) => client_with_ca(info, ca),
                    None => redis::Client::open(info),
                }
                .map_err(err)?;
                let config = redis::aio::ConnectionManagerConfig::new()
                    .set_response_timeout(Some(options.response_timeout))
                    .set_connection_timeout(Some(options.connect_timeout))
                    .set_number_of_retries(3)
                    .set_max_delay(Duration::from_millis(500))
                    .set_push_sender(push)
                    .set_automatic_resubscription();
                // The manager's own tries (3, each up to the connection
                // timeout) would let a silent server hold a connect 20 s.
                let limit = options.connect_timeout;
                let manager =
                    tokio::time::timeout(limit, ConnectionManager::new_with_config(client, config))
                        .await
                        .map_err(|_| {
                            Error::connection(
                                crate::node::NAME,
                                addr,
                                format!(
                                    "no answer within {} (connect_timeout=)",
                                    humantime::format_duration(limit)
                                ),
                            )
                        })?
                        .map_err(err)?;
                Ok(Conn::Single(manager))
            }
            Target::Cluster(nodes) => {
                let builder = redis::cluster::ClusterClientBuilder::new(nodes.clone());
                let client = cluster_with_ca(builder, ca)
                    .use_protocol(ProtocolVersion::RESP3)
                    .push_sender(push)
                    .response_timeout(options.response_timeout)
                    .connection_timeout(options.connect_timeout)
                    .retries(3)
                    .build()
                    .map_err(err)?;
                Ok(Conn::Cluster(
                    client.get_async_connection().await.map_err(err)?,
                ))
            }
            Target::Sentinel(t) => {
                let master = sentinel_master(t, options, push)?;
                master.check_service().await.map_err(Error::config)?;
                Ok(Conn::Sentinel(master))
            }
        }
    }

    /// EVALSHA, loading the script on NOSCRIPT. On a cluster the script is
    /// loaded only on the primary that serves the call's key (redis-rs would
    /// load it on every node, so one stalled node would hold every call up).
    /// A `SCRIPT FLUSH` between the load and the call yields NOSCRIPT again;
    /// that is retried a few times.
    pub(crate) async fn invoke<T: FromRedisValue>(&self, call: Call<'_>) -> redis::RedisResult<T> {
        let evalsha = call.evalsha();
        let mut tries = 0;
        loop {
            match self.query(&evalsha).await {
                Err(e) if tries < 3 && is_noscript(&e) => tries += 1,
                other => return other,
            }
            let load = call.lua().load_cmd();
            match (self, call.first_key()) {
                (Conn::Cluster(c), Some(key)) => {
                    let route = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(
                        Route::with_key(key, SlotAddr::Master),
                    ));
                    c.clone().route_command(load, route).await?;
                }
                _ => {
                    self.query::<String>(&load).await?;
                }
            }
        }
    }

    /// Loads `scripts` (on every primary of a cluster).
    pub(crate) async fn preload(
        &self,
        scripts: &[&std::sync::LazyLock<crate::scripts::Lua>],
    ) -> redis::RedisResult<()> {
        for lua in scripts {
            let load = lua.load_cmd();
            match self {
                Conn::Single(_) | Conn::Sentinel(_) => {
                    self.query::<String>(&load).await?;
                }
                Conn::Cluster(c) => {
                    let all = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None));
                    c.clone().route_command(load, all).await?;
                }
            }
        }
        Ok(())
    }

    /// A plain command.
    pub(crate) async fn query<T: FromRedisValue>(&self, cmd: &Cmd) -> redis::RedisResult<T> {
        match self {
            Conn::Single(c) => cmd.query_async(&mut c.clone()).await,
            Conn::Cluster(c) => cmd.query_async(&mut c.clone()).await,
            Conn::Sentinel(m) => m.query(cmd).await,
        }
    }

    /// A command sent to every primary, with array replies combined.
    /// The keys matching `pattern`, by `SCAN` (which, unlike `KEYS`, does not
    /// block the server on a large keyspace); on a cluster, on every primary.
    pub(crate) async fn scan_keys(&self, pattern: &str) -> redis::RedisResult<Vec<String>> {
        match self {
            Conn::Single(c) => {
                scan(pattern, |cmd| {
                    let mut c = c.clone();
                    async move { cmd.query_async(&mut c).await }
                })
                .await
            }
            Conn::Sentinel(m) => scan(pattern, |cmd| async move { m.query(&cmd).await }).await,
            Conn::Cluster(c) => {
                let slots: Value = redis::cmd("CLUSTER")
                    .arg("SLOTS")
                    .query_async(&mut c.clone())
                    .await?;
                let Some(nodes) = primaries(&slots) else {
                    // Some node is named by no usable address (an empty or `?`
                    // host): ask every primary with KEYS instead.
                    let mut cmd = redis::cmd("KEYS");
                    cmd.arg(pattern);
                    let all = RoutingInfo::MultiNode((
                        MultipleNodeRoutingInfo::AllMasters,
                        Some(ResponsePolicy::CombineArrays),
                    ));
                    let v = c.clone().route_command(cmd, all).await?;
                    return FromRedisValue::from_redis_value(v).map_err(RedisError::from);
                };
                let mut out = Vec::new();
                for (host, port) in nodes {
                    let keys = scan(pattern, |cmd| {
                        let mut c = c.clone();
                        let route = RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                            host: host.clone(),
                            port,
                        });
                        async move {
                            let v = c.route_command(cmd, route).await?;
                            FromRedisValue::from_redis_value(v).map_err(RedisError::from)
                        }
                    })
                    .await?;
                    out.extend(keys);
                }
                Ok(out)
            }
        }
    }

    pub(crate) async fn subscribe(&self, channel: &str) -> redis::RedisResult<()> {
        match self {
            Conn::Single(c) => c.clone().subscribe(channel).await,
            Conn::Cluster(c) => c.clone().subscribe(channel).await,
            Conn::Sentinel(m) => m.subscribe(channel).await,
        }
    }

    pub(crate) async fn unsubscribe(&self, channel: &str) -> redis::RedisResult<()> {
        match self {
            Conn::Single(c) => c.clone().unsubscribe(channel).await,
            Conn::Cluster(c) => c.clone().unsubscribe(channel).await,
            Conn::Sentinel(m) => m.unsubscribe(channel).await,
        }
    }

    /// Cluster only: each slot range and its primary, by `CLUSTER SLOTS`
    /// asked of every primary, the first answer taken (a stalled primary
    /// does not hold it up); `None` on a single server, or when a node has
    /// no usable address.
    pub(crate) async fn slot_ranges(&self) -> redis::RedisResult<Option<Vec<SlotRange>>> {
        let Conn::Cluster(c) = self else {
            return Ok(None);
        };
        let mut cmd = redis::cmd("CLUSTER");
        cmd.arg("SLOTS");
        let first = RoutingInfo::MultiNode((
            MultipleNodeRoutingInfo::AllMasters,
            Some(ResponsePolicy::OneSucceeded),
        ));
        let slots = c.clone().route_command(cmd, first).await?;
        Ok(slot_primaries(&slots))
    }

    /// Cluster only: `cmds` as one pipeline to the node at `host:port`, with
    /// each command's reply (an error reply as [`Value::ServerError`]); not
    /// redirected if a slot moved.
    pub(crate) async fn pipeline_at(
        &self,
        cmds: Vec<Cmd>,
        host: &str,
        port: u16,
    ) -> redis::RedisResult<Vec<Value>> {
        let Conn::Cluster(c) = self else {
            return Err(RedisError::from((
                redis::ErrorKind::Client,
                "a pipeline to one node of a cluster",
            )));
        };
        let count = cmds.len();
        let mut pipe = redis::pipe();
        for cmd in cmds {
            pipe.add_command(cmd);
        }
        let route = SingleNodeRoutingInfo::ByAddress {
            host: host.to_string(),
            port,
        };
        c.clone().route_pipeline(pipe, 0, count, route).await
    }

    pub(crate) fn is_cluster(&self) -> bool {
        matches!(self, Conn::Cluster(_))
    }
}

/// The master of the service `t` names, through its Sentinels (connected
/// at the first command).
fn sentinel_master(
    t: &SentinelTarget,
    options: &RedisOptions,
    push: UnboundedSender<PushInfo>,
) -> Result<Arc<Master>> {
    let (sentinels, node) = sentinel_logins(t)?;
    let config = redis::AsyncConnectionConfig::new()
        .set_response_timeout(Some(options.response_timeout))
        .set_connection_timeout(Some(options.connect_timeout))
        .set_push_sender(push.clone());
    Ok(Master::new(
        sentinels,
        node,
        config,
        push,
        options.connect_timeout,
        t.service.clone(),
    ))
}

/// One client per Sentinel (with the Sentinels' login), and the data nodes'
/// login and database.
pub(crate) fn sentinel_logins(
    t: &SentinelTarget,
) -> Result<(Vec<redis::Client>, redis::RedisConnectionInfo)> {
    let bad = |e: RedisError| Error::config(format!("redis+sentinel: {e}"));
    let mut login = redis::RedisConnectionInfo::default();
    if let Some(u) = &t.sentinel_user {
        login = login.set_username(u);
    }
    if let Some(p) = &t.sentinel_password {
        login = login.set_password(p);
    }
    let mut sentinels = Vec::new();
    for (host, port) in &t.sentinels {
        let info = redis::ConnectionAddr::Tcp(host.clone(), *port)
            .into_connection_info()
            .map_err(bad)?
            .set_redis_settings(login.clone());
        sentinels.push(redis::Client::open(info).map_err(bad)?);
    }
    let mut node = redis::RedisConnectionInfo::default()
        .set_db(t.db)
        .set_protocol(ProtocolVersion::RESP3);
    if let Some(u) = &t.user {
        node = node.set_username(u);
    }
    if let Some(p) = &t.password {
        node = node.set_password(p);
    }
    Ok((sentinels, node))
}

/// Runs `SCAN … MATCH pattern` through `run` until the cursor comes back to 0.
async fn scan<F, Fut>(pattern: &str, mut run: F) -> redis::RedisResult<Vec<String>>
where
    F: FnMut(Cmd) -> Fut,
    Fut: Future<Output = redis::RedisResult<(String, Vec<String>)>>,
{
    let mut cursor = "0".to_string();
    let mut out = Vec::new();
    loop {
        let mut cmd = redis::cmd("SCAN");
        cmd.arg(&cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(1000);
        let (next, keys) = run(cmd).await?;
        out.extend(keys);
        if next == "0" {
            return Ok(out);
        }
        cursor = next;
    }
}

/// Each slot range of a `CLUSTER SLOTS` reply with its primary (the range's
/// first node): (first slot, last slot, host, port); `None` if one of them
/// has no usable address.
fn slot_primaries(slots: &Value) -> Option<Vec<SlotRange>> {
    let Value::Array(ranges) = slots else {
        return None;
    };
    let mut out = Vec::with_capacity(ranges.len());
    for range in ranges {
        let Value::Array(fields) = range else {
            return None;
        };
        let (Some(Value::Int(first)), Some(Value::Int(last)), Some(Value::Array(node))) =
            (fields.first(), fields.get(1), fields.get(2))
        else {
            return None;
        };
        let host = match node.first() {
            Some(Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
            Some(Value::SimpleString(s)) => s.clone(),
            _ => return None,
        };
        let Some(Value::Int(port)) = node.get(1) else {
            return None;
        };
        if host.is_empty() || host == "?" {
            return None;
        }
        out.push(SlotRange {
            first: u16::try_from(*first).ok()?,
            last: u16::try_from(*last).ok()?,
            host,
            port: u16::try_from(*port).ok()?,
        });
    }
    Some(out)
}

/// The primaries' addresses in a `CLUSTER SLOTS` reply, each once.
fn primaries(slots: &Value) -> Option<Vec<(String, u16)>> {
    let mut out: Vec<(String, u16)> = Vec::new();
    for r in slot_primaries(slots)? {
        let addr = (r.host, r.port);
        if !out.contains(&addr) {
            out.push(addr);
        }
    }
    Some(out)
}

/// A range of cluster slots and the primary serving it.
#[derive(Debug, Clone)]
pub(crate) struct SlotRange {
    pub(crate) first: u16,
    pub(crate) last: u16,
    pub(crate) host: String,
    pub(crate) port: u16,
}

/// The cluster slot of `key` (CRC16 of its hash tag, or of the whole key,
/// modulo 16384), as Redis computes it.
pub(crate) fn slot_of(key: &[u8]) -> u16 {
    let tag = key
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let rest = &key[open + 1..];
            rest.iter()
                .position(|&b| b == b'}')
                .map(|close| &rest[..close])
        })
        .filter(|tag| !tag.is_empty())
        .unwrap_or(key);
    crc16::State::<crc16::XMODEM>::calculate(tag) % 16384
}
