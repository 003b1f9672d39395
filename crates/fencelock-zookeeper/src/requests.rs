//! The client's requests: sessions per TTL class, lock nodes, waiting on
//! the predecessor, renewals that sync with the leader first, the sweep.

use super::*;

impl Inner {
    /// The primary session's client, for reads about locks in general
    /// (`inspect`, `list`, operators' deletes); opened anew if it has ended.
    /// A hold's own operations go through the session its node lives in: a
    /// session sees its own writes in order, another may be behind.
    pub(crate) async fn client(&self) -> Result<zk::Client> {
        self.ensure_live(&self.primary).await?;
        Ok(self.primary.client())
    }

    /// [`Inner::client`], caught up with the leader on `path` (a `sync`): its
    /// reads see every write made before, through any session — this
    /// client's holds live in sessions of their own, on other servers maybe.
    pub(crate) async fn synced(&self, path: &str) -> Result<zk::Client> {
        let client = self.client().await?;
        client.sync(path).await.map_err(|e| self.err(e))?;
        Ok(client)
    }

    /// The live session for holds of `ttl`: of `min(ceil(ttl), session_timeout)`
    /// whole seconds, opened on first use, and opened anew if it has ended
    /// (expired, closed: the holds of the old one are gone, as their renewals
    /// say; new acquires work again).
    pub(crate) async fn session(&self, ttl: Duration) -> Result<Arc<Session>> {
        let secs = ttl.as_secs_f64().ceil().max(1.0) as u64;
        let timeout = Duration::from_secs(secs).min(self.options.session_timeout);
        let session = if timeout >= self.primary.timeout {
            self.primary.clone()
        } else {
            let key = timeout.as_millis() as u64;
            let mut classes = self.classes.lock().await;
            match classes.get(&key) {
                Some(s) => s.clone(),
                None => {
                    let client = self.connect.open(&self.address, timeout).await?;
                    let s = Arc::new(Session {
                        client: std::sync::RwLock::new(client),
                        timeout,
                        reconnecting: tokio::sync::Mutex::new(()),
                    });
                    classes.insert(key, s.clone());
                    s
                }
            }
        };
        self.ensure_live(&session).await?;
        Ok(session)
    }

    /// Opens `session` anew if it has ended.
    pub(crate) async fn ensure_live(&self, session: &Session) -> Result<()> {
        let ended = |c: &zk::Client| {
            matches!(
                c.state(),
                zk::SessionState::Expired | zk::SessionState::Closed | zk::SessionState::AuthFailed
            )
        };
        if !ended(&session.client()) {
            return Ok(());
        }
        let _one = session.reconnecting.lock().await;
        if !ended(&session.client()) {
            return Ok(());
        }
        tracing::warn!(address = %self.address, "a ZooKeeper session ended; opening a new one (its holds are lost)");
        let fresh = self.connect.open(&self.address, session.timeout).await?;
        *session.client.write().unwrap_or_else(|p| p.into_inner()) = fresh;
        Ok(())
    }

    pub(crate) fn err(&self, e: zk::Error) -> Error {
        zk_err(e, &self.address)
    }

    pub(crate) fn lock_path(&self, key: &Key) -> String {
        format!("{}/{}", self.options.prefix, escape_key(key.as_str()))
    }

    /// Deletes `path` through `session` (the one that made it, so that it
    /// sees it); a node that is already gone is fine; a failure is retried
    /// later.
    pub(crate) async fn delete_node(&self, session: &Arc<Session>, path: &str) {
        match session.client().delete(path, None).await {
            Ok(()) | Err(zk::Error::NoNode) => {}
            Err(_) => lock(&self.orphans).push((path.to_string(), session.clone())),
        }
    }

    /// Deletes every child of `lock_path` whose name starts with `protected`
    /// (the nodes of one acquire); retried by the janitor if ZooKeeper cannot
    /// be reached now.
    pub(crate) async fn delete_protected(
        &self,
        session: &Arc<Session>,
        lock_path: &str,
        protected: &str,
    ) {
        match session.client().list_children(lock_path).await {
            Ok(children) => {
                for c in children.into_iter().filter(|c| c.starts_with(protected)) {
                    self.delete_node(session, &format!("{lock_path}/{c}")).await;
                }
            }
            Err(zk::Error::NoNode) => {}
            Err(_) => {
                lock(&self.orphans).push((format!("{lock_path}/{protected}*"), session.clone()))
            }
        }
    }

    /// Creates the queue node (making the lock path if needed) with the
    /// protected prefix `protected`, and returns its name and czxid. After a
    /// lost reply the node is looked for by its prefix (Curator's protected
    /// mode) before another create is sent; if a retry made two, the later
    /// one is deleted.
    pub(crate) async fn create_node(
        &self,
        session: &Arc<Session>,
        lock_path: &str,
        protected: &str,
        kind: Kind,
        data: &[u8],
    ) -> Result<(String, u64)> {
        let path = format!(
            "{lock_path}/{protected}{}",
            kind.fragment(self.options.writer)
        );
        let options = zk::CreateMode::EphemeralSequential.with_acls(zk::Acls::anyone_all());
        for _ in 0..5 {
            match session.client().create(&path, data, &options).await {
                Ok((stat, seq)) => {
                    return Ok((
                        format!("{protected}{}{seq}", kind.fragment(self.options.writer)),
                        stat.czxid as u64,
                    ));
                }
                Err(zk::Error::NoNode) => {
                    let dir = zk::CreateMode::Container.with_acls(zk::Acls::anyone_all());
                    session
                        .client()
                        .mkdir(lock_path, &dir)
                        .await
                        .map_err(|e| self.err(e))?;
                }
                Err(zk::Error::ConnectionLoss) => {
                    // The create may have happened: look for our prefix, and
                    // do not create again until the look succeeded.
                    if let Some(found) = self.find_protected(session, lock_path, protected).await? {
                        return Ok(found);
                    }
                }
                Err(e) => return Err(self.err(e)),
            }
        }
        Err(Error::backend(
            NAME,
            format!("could not create a lock node under {lock_path}"),
        ))
    }

    /// The node of `lock_path` with the prefix `protected` (the first, if a
    /// retried create made more: the others are deleted), read until the
    /// read succeeds (bounded).
    pub(crate) async fn find_protected(
        &self,
        session: &Arc<Session>,
        lock_path: &str,
        protected: &str,
    ) -> Result<Option<(String, u64)>> {
        for _ in 0..100 {
            match session.client().list_children(lock_path).await {
                Ok(children) => {
                    let mut ours: Vec<names::LockNode> = sorted_nodes(&children)
                        .into_iter()
                        .filter(|n| n.name.starts_with(protected))
                        .collect();
                    if ours.is_empty() {
                        return Ok(None);
                    }
                    for extra in ours.split_off(1) {
                        self.delete_node(session, &format!("{lock_path}/{}", extra.name))
                            .await;
                    }
                    let name = ours.remove(0).name;
                    let (_, stat) = session
                        .client()
                        .get_data(&format!("{lock_path}/{name}"))
                        .await
                        .map_err(|e| self.err(e))?;
                    return Ok(Some((name, stat.czxid as u64)));
                }
                Err(zk::Error::NoNode) => return Ok(None),
                Err(zk::Error::ConnectionLoss) => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => return Err(self.err(e)),
            }
        }
        Err(Error::connection(
            NAME,
            &self.address,
            format!(
                "lost the connection while creating a lock node under {lock_path}, and could not look for it"
            ),
        ))
    }

    /// Waits until the node `name` holds the lock, and returns when the read
    /// that showed it so was sent (the hold's validity counts from there: the
    /// node, and so its session, was alive then); `None` if `deadline` passed.
    pub(crate) async fn wait_turn(
        &self,
        session: &Session,
        created: Instant,
        lock_path: &str,
        name: &str,
        permits: u32,
        deadline: Option<Instant>,
    ) -> Result<Option<Instant>> {
        let mut first = true;
        loop {
            let client = session.client();
            // The first look follows this session's own create, which reached
            // the leader after `created`: what it shows is no older than that,
            // and the session lived then. A later look may be served by a
            // server cut off from the leader (stale for up to syncLimit
            // ticks, while the leader expires this session): `sync` first, so
            // the look is as new as the leader's state when it was sent.
            let sent = if std::mem::take(&mut first) {
                created
            } else {
                let sent = Instant::now();
                match client.sync(lock_path).await {
                    Ok(()) => {}
                    Err(zk::Error::ConnectionLoss)
                        if deadline.is_none_or(|d| Instant::now() < d) =>
                    {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                    Err(e) => return Err(self.err(e)),
                }
                sent
            };
            let children = match client.list_children(lock_path).await {
                Ok(c) => c,
                Err(zk::Error::ConnectionLoss) if deadline.is_none_or(|d| Instant::now() < d) => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
                Err(e) => return Err(self.err(e)),
            };
            let nodes = sorted_nodes(&children);
            let Some(index) = nodes.iter().position(|n| n.name == name) else {
                return Err(Error::backend(
                    NAME,
                    format!(
                        "the queue node {lock_path}/{name} vanished while waiting (session expired or deleted)"
                    ),
                ));
            };
            let watcher = match blocker(&nodes, index, permits) {
                None => return Ok(Some(sent)),
                Some(_) if deadline.is_some_and(|d| Instant::now() >= d) => return Ok(None),
                Some(Wait::Node(n)) => match client
                    .check_and_watch_stat(&format!("{lock_path}/{}", n.name))
                    .await
                {
                    // Gone already: look again.
                    Ok((None, _)) => continue,
                    Ok((Some(_), w)) => w,
                    Err(zk::Error::ConnectionLoss) => continue,
                    Err(e) => return Err(self.err(e)),
                },
                Some(Wait::Children) => {
                    match client.get_and_watch_children(lock_path).await {
                        Ok((now, _, w)) => {
                            let nodes = sorted_nodes(&now);
                            match nodes.iter().position(|n| n.name == name) {
                                // Free meanwhile: look again, synced.
                                Some(i) if blocker(&nodes, i, permits).is_none() => continue,
                                _ => w,
                            }
                        }
                        Err(zk::Error::ConnectionLoss) => continue,
                        Err(e) => return Err(self.err(e)),
                    }
                }
            };
            let until = async {
                match deadline {
                    Some(d) => tokio::time::sleep_until(d).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = watcher.changed() => {
                    self.watch_events.fetch_add(1, Ordering::Relaxed);
                }
                _ = until => {}
            }
        }
    }

    /// The permit count of another semaphore node of `lock_path` than `name`
    /// that differs from `permits`, if any (read from the nodes' data,
    /// `owner\tpermits`).
    pub(crate) async fn other_count(
        &self,
        session: &Session,
        lock_path: &str,
        name: &str,
        permits: u32,
    ) -> Result<Option<u32>> {
        let client = session.client();
        let children = client
            .list_children(lock_path)
            .await
            .map_err(|e| self.err(e))?;
        for n in sorted_nodes(&children) {
            if n.kind != Kind::Permit || n.name == name {
                continue;
            }
            let data = match client.get_data(&format!("{lock_path}/{}", n.name)).await {
                Ok((data, _)) => data,
                Err(zk::Error::NoNode) => continue,
                Err(e) => return Err(self.err(e)),
            };
            let held = std::str::from_utf8(&data)
                .ok()
                .and_then(|d| d.rsplit_once('\t'))
                .and_then(|(_, n)| n.parse::<u32>().ok());
            if let Some(held) = held.filter(|h| *h != permits) {
                return Ok(Some(held));
            }
        }
        Ok(None)
    }

    /// Deletes holds nobody renewed within their TTL, and retries orphans.
    pub(crate) async fn sweep(&self) {
        let now = Instant::now();
        let expired: Vec<(String, Arc<Session>)> = {
            lock(&self.holds)
                .remove_where(|h| h.renewed_until <= now)
                .into_iter()
                .map(|h| (h.node, h.session))
                .collect()
        };
        let orphans = std::mem::take(&mut *lock(&self.orphans));
        for (path, session) in expired.into_iter().chain(orphans) {
            // `<lock path>/<protected prefix>*`: the nodes of one acquire.
            match path.strip_suffix('*').and_then(|p| p.rsplit_once('/')) {
                Some((lock_path, protected)) => {
                    self.delete_protected(&session, lock_path, protected).await
                }
                None => self.delete_node(&session, &path).await,
            }
        }
    }

    /// Renews the holds `of_session` (index into `leases`, node) of one
    /// session: a `sync` (so a server cut off from the leader, which would
    /// answer from stale state while the leader expires the session, fails
    /// instead), then one multi-read through that session, whose nodes must
    /// still be its own. The validity counts from before the `sync`.
    pub(crate) async fn renew_session(
        &self,
        leases: &[LeaseRef],
        session: &Arc<Session>,
        of_session: Vec<(usize, String)>,
    ) -> Vec<(usize, Renewal)> {
        let all = |r: Renewal| of_session.iter().map(|(i, _)| (*i, r.clone())).collect();
        let client = session.client();
        match client.state() {
            zk::SessionState::Expired | zk::SessionState::AuthFailed | zk::SessionState::Closed => {
                return all(Renewal::Lost {
                    reason: "the ZooKeeper session ended; its ephemeral nodes are gone".into(),
                });
            }
            zk::SessionState::Disconnected => {
                return all(Renewal::Unknown {
                    reason: "disconnected from ZooKeeper; the session may still recover".into(),
                });
            }
            _ => {}
        }
        let start = Instant::now();
        if let Err(e) = client.sync("/").await {
            return all(Renewal::Unknown {
                reason: format!("ZooKeeper did not sync with its leader: {e}"),
            });
        }
        let mut reader = client.new_multi_reader();
        for (_, node) in &of_session {
            if let Err(e) = reader.add_get_data(node) {
                return all(Renewal::Unknown {
                    reason: format!("cannot read {node}: {e}"),
                });
            }
        }
        let results = match reader.commit().await {
            Ok(r) => r,
            Err(e) => {
                return all(Renewal::Unknown {
                    reason: format!("ZooKeeper did not answer: {e}"),
                });
            }
        };
        let id = session.id();
        let mut holds = lock(&self.holds);
        of_session
            .iter()
            .zip(results)
            .map(|((i, node), result)| {
                let ours = matches!(result, zk::MultiReadResult::Data { stat, .. } if stat.ephemeral_owner == id);
                let lease = &leases[*i];
                let renewal = match holds.of_lease_mut(lease) {
                    Some(h) if ours && h.node == *node => {
                        h.renewed_until = start + h.ttl;
                        Renewal::Held { ttl: h.ttl }
                    }
                    _ => {
                        if !ours
                            && let Some(token) = lease.token
                            && holds.of_lease(lease).is_some_and(|h| h.node == *node)
                        {
                            holds.remove(&lease.key, &lease.owner, token.get());
                        }
                        Renewal::Lost {
                            reason: "the lock node is gone (deleted, or the session that owned it expired)"
                                .into(),
                        }
                    }
                };
                (*i, renewal)
            })
            .collect()
    }

    /// A hold's TTL in `session`: at most 3/4 of the session timeout the
    /// server granted (which may be below the one asked for,
    /// `maxSessionTimeout`), since the session's end ends the hold. The
    /// quarter is the leader's lag: a follower reports its sessions'
    /// heartbeats to the leader every half tick, and a timeout is at least
    /// two ticks, so the leader may count a session's timeout from up to a
    /// quarter of it before the check this client counts from.
    pub(crate) fn grant_ttl(&self, ttl: Duration, session: &Session) -> Duration {
        ttl.min(session.client().session_timeout().mul_f64(0.75))
    }
}
