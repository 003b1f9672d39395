//! The faults a campaign injects, and which of them a target supports.

use crate::servers::SpawnKind;

/// One kind of fault (`--faults`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum FaultKind {
    /// SIGSTOP of a client (a holder if one holds) past its TTL, then SIGCONT.
    Pause,
    /// SIGKILL of a client; a new one starts after a while.
    Kill,
    /// The proxies between a client and every server drop all traffic.
    Partition,
    /// Requests reach the servers, the replies are dropped (connections cut on healing).
    LostReply,
    /// The proxies delay every chunk by 20–300 ms.
    Latency,
    /// A frozen VM: a client's proxies hold its next request on every
    /// connection (a statement boundary: inside a transaction if one is
    /// open) and the client is SIGSTOPped, past its TTL; both heal at once.
    Freeze,
    /// A client's wall clock, as fencelock reads it, is off by up to ±5 s.
    Clock,
    /// A server (one member) is SIGKILLed and restarted with its data.
    Restart,
    /// A server (one member) is SIGKILLed and restarted empty.
    RestartEmpty,
    /// The leader of an etcd cluster or ZooKeeper ensemble is SIGKILLed, later restarted.
    Leader,
    /// A minority of members (2 of 5 Redlock instances, 1 of 3 members) is SIGKILLed.
    Minority,
    /// A majority of members (3 of 5, 2 of 3) is SIGKILLed: no quorum until they return.
    Majority,
    /// A Redis master is cut off from its replica for a while, then
    /// SIGKILLed; the Sentinels promote the replica, which lacks what the
    /// master granted meanwhile. The old master comes back as a replica.
    Failover,
}

impl FaultKind {
    /// Every kind with its name.
    pub const ALL: [(&'static str, FaultKind); 13] = [
        ("pause", FaultKind::Pause),
        ("kill", FaultKind::Kill),
        ("partition", FaultKind::Partition),
        ("lost-reply", FaultKind::LostReply),
        ("latency", FaultKind::Latency),
        ("freeze", FaultKind::Freeze),
        ("clock", FaultKind::Clock),
        ("restart", FaultKind::Restart),
        ("restart-empty", FaultKind::RestartEmpty),
        ("leader", FaultKind::Leader),
        ("minority", FaultKind::Minority),
        ("majority", FaultKind::Majority),
        ("failover", FaultKind::Failover),
    ];

    /// Parses a comma-separated list of names (`all` for every kind).
    ///
    /// # Errors
    ///
    /// The unknown name, with the known ones.
    pub fn parse_list(s: &str) -> Result<Vec<FaultKind>, String> {
        let mut out = Vec::new();
        for name in s.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            if name == "all" {
                out.extend(Self::ALL.iter().map(|(_, k)| *k));
                continue;
            }
            match Self::ALL.iter().find(|(n, _)| *n == name) {
                Some((_, k)) => out.push(*k),
                None => {
                    return Err(format!(
                        "unknown fault {name:?}; known: all, {}",
                        Self::ALL.map(|(n, _)| n).join(", ")
                    ));
                }
            }
        }
        out.sort();
        out.dedup();
        Ok(out)
    }

    /// Its name.
    pub fn name(self) -> &'static str {
        Self::ALL
            .iter()
            .find(|(_, k)| *k == self)
            .map_or("?", |(n, _)| n)
    }

    /// `None` if this fault can be injected on a target with these
    /// properties, else why not.
    pub fn unsupported(
        self,
        proxied: bool,
        cluster_topology: bool,
        spawned: Option<SpawnKind>,
    ) -> Option<&'static str> {
        use FaultKind::*;
        use SpawnKind as S;
        match self {
            Pause | Kill | Clock => None,
            Partition | LostReply | Latency | Freeze if cluster_topology => {
                Some("Redis Cluster and Sentinel clients follow the topology around the proxies")
            }
            Partition | LostReply | Latency | Freeze if !proxied => {
                Some("the backend has no network server")
            }
            Partition | LostReply | Latency | Freeze => None,
            _ if spawned.is_none() => {
                Some("needs servers the tool started (--spawn); only a URL was given")
            }
            Failover => match spawned {
                Some(S::RedisSentinel | S::RedisSentinelWait | S::RedisCluster) => None,
                _ => Some("only a Redis Sentinel setup or a cluster with replicas fails over"),
            },
            _ if matches!(
                spawned,
                Some(S::RedisSentinel | S::RedisSentinelWait | S::RedisCluster)
            ) =>
            {
                Some("a replicated Redis setup's server fault is failover")
            }
            Restart => match spawned {
                Some(S::Memcached) => Some("memcached keeps no data: its restart is restart-empty"),
                _ => None,
            },
            RestartEmpty => match spawned {
                Some(S::Redis | S::Memcached | S::Redlock) => None,
                _ => Some("only Redis, Redlock and memcached members can come back empty"),
            },
            Leader => match spawned {
                Some(S::Etcd | S::Zookeeper) => None,
                _ => Some("no leader: only etcd and ZooKeeper elect one"),
            },
            Minority | Majority => match spawned {
                Some(S::Etcd | S::Zookeeper | S::Redlock) => None,
                _ => Some("a single server has no minority or majority"),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_and_bad_ones_are_named() {
        assert_eq!(
            FaultKind::parse_list("pause, kill,pause").unwrap(),
            [FaultKind::Pause, FaultKind::Kill]
        );
        assert_eq!(
            FaultKind::parse_list("all").unwrap().len(),
            FaultKind::ALL.len()
        );
        let e = FaultKind::parse_list("pause,gc").unwrap_err();
        assert!(e.contains("\"gc\"") && e.contains("lost-reply"), "{e}");
    }

    #[test]
    fn server_faults_need_spawned_servers() {
        assert!(FaultKind::Restart.unsupported(true, false, None).is_some());
        assert!(
            FaultKind::Restart
                .unsupported(true, false, Some(SpawnKind::Redis))
                .is_none()
        );
        assert!(
            FaultKind::Restart
                .unsupported(true, false, Some(SpawnKind::Memcached))
                .is_some()
        );
        assert!(
            FaultKind::Partition
                .unsupported(false, false, None)
                .is_some()
        );
        assert!(
            FaultKind::Leader
                .unsupported(true, false, Some(SpawnKind::Redis))
                .is_some()
        );
    }
}
