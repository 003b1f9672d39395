//! The client's requests: retried through elections, sessions per TTL
//! class, queue reads and watches, and the janitor's sweep.

use super::*;

impl Inner {
    pub(crate) fn err(&self, e: etcd_client::Error) -> Error {
        etcd_err(e, &self.address)
    }

    /// Runs one request, trying again after transient failures and after
    /// tries that take more than a third of the request timeout (a request
    /// stuck on a member that just died, or behind an election), until the
    /// request timeout has passed. Requests are written so that running one
    /// twice does no harm.
    pub(crate) async fn call<T, F, Fut>(&self, mut op: F) -> Result<T>
    where
        F: FnMut(Client) -> Fut,
        Fut: Future<Output = std::result::Result<T, etcd_client::Error>>,
    {
        let give_up = Instant::now() + self.options.request_timeout;
        let one_try = (self.options.request_timeout / 3).max(Duration::from_millis(500));
        loop {
            let left = give_up.saturating_duration_since(Instant::now());
            match tokio::time::timeout(one_try.min(left), op(self.client.clone())).await {
                Ok(Ok(v)) => return Ok(v),
                Ok(Err(e)) if transient(&e) && Instant::now() + RETRY_PAUSE < give_up => {
                    tokio::time::sleep(RETRY_PAUSE).await;
                }
                Ok(Err(e)) => return Err(self.err(e)),
                Err(_) if Instant::now() + RETRY_PAUSE < give_up => {}
                Err(_) => {
                    return Err(Error::connection(
                        NAME,
                        &self.address,
                        format!(
                            "no answer within the request timeout of {:?}",
                            self.options.request_timeout
                        ),
                    ));
                }
            }
        }
    }

    /// The prefix of a lock's keys: `<prefix><key>/`.
    pub(crate) fn lock_prefix(&self, key: &str) -> String {
        format!("{}{key}/", self.options.prefix)
    }

    /// A key name for a new hold of `lease` under `lock_prefix`, reserved
    /// until that key is seen deleted.
    pub(crate) fn reserve_name(&self, lock_prefix: &str, lease: i64) -> String {
        let mut names = lock(&self.names);
        let mut name = format!("{lock_prefix}{lease:x}");
        while names.contains(&name) {
            let n = self.next_name.fetch_add(1, Ordering::Relaxed) + 1;
            name = format!("{lock_prefix}{lease:x}-{n}");
        }
        names.insert(name.clone());
        name
    }

    /// Deletes one of this client's keys; a failure is retried later.
    pub(crate) async fn delete_node(&self, key: &str) {
        let k = key.to_string();
        match self
            .call(|mut c| {
                let k = k.clone();
                async move { c.delete(k, None).await }
            })
            .await
        {
            Ok(_) => {
                if !lock(&self.cancelled).iter().any(|(n, _, _)| n == key) {
                    lock(&self.names).remove(key);
                }
            }
            Err(_) => lock(&self.orphans).push(key.to_string()),
        }
    }

    /// The lock's keys in create-revision order.
    pub(crate) async fn queue(&self, lock_prefix: &str) -> Result<Vec<Node>> {
        let p = lock_prefix.to_string();
        let resp = self
            .call(|mut c| {
                let p = p.clone();
                async move { c.get(p, Some(range())).await }
            })
            .await?;
        Ok(nodes(lock_prefix, &resp))
    }

    /// Puts `node` (if absent) attached to `lease`, reading the queue in the
    /// same transaction. Returns the queue.
    pub(crate) async fn enqueue(
        &self,
        lock_prefix: &str,
        node: &str,
        lease: i64,
        value: String,
    ) -> Result<Vec<Node>> {
        let txn = Txn::new()
            .when([Compare::create_revision(node, CompareOp::Equal, 0)])
            .and_then([
                TxnOp::put(node, value, Some(PutOptions::new().with_lease(lease))),
                TxnOp::get(lock_prefix, Some(range())),
            ])
            .or_else([TxnOp::get(lock_prefix, Some(range()))]);
        let resp = self
            .call(|mut c| {
                let t = txn.clone();
                async move { c.txn(t).await }
            })
            .await?;
        let read = resp.op_responses().into_iter().find_map(|r| match r {
            TxnOpResponse::Get(g) => Some(g),
            _ => None,
        });
        let Some(read) = read else {
            return Err(Error::backend(NAME, "a lock transaction returned no read"));
        };
        Ok(nodes(lock_prefix, &read))
    }

    /// Waits until `node` holds (`Some(when it was seen holding, its create
    /// revision)`) or `deadline` passes (`None`).
    ///
    /// Watch, then read: the read after the watch shows any deletion that
    /// came before it, the watch any after. A watch opened at a past revision
    /// is caught up by the server's 100 ms sync pass, and so is one opened at
    /// the current revision while a write was being applied (etcd takes "now"
    /// before it registers the watch); so the queue is read again after
    /// `FIRST_RECHECK` without an event, then at doubling intervals.
    pub(crate) async fn wait_turn(
        &self,
        lock_prefix: &str,
        node: &str,
        permits: u32,
        deadline: Option<Instant>,
        mut queue: Vec<Node>,
        mut read_at: Instant,
    ) -> Result<Option<(Instant, i64)>> {
        let mut watching: Option<(String, WatchStream)> = None;
        let mut recheck = FIRST_RECHECK;
        loop {
            let Some(index) = queue.iter().position(|n| n.key == node) else {
                return Err(Error::backend(
                    NAME,
                    format!(
                        "the queue key {node} vanished while waiting (its lease expired, or it was deleted)"
                    ),
                ));
            };
            let target = match blocker(&queue, index, permits) {
                None => return Ok(Some((read_at, queue[index].rev))),
                Some(_) if deadline.is_some_and(|d| Instant::now() >= d) => return Ok(None),
                Some(Wait::Node(n)) => n.key.clone(),
                Some(Wait::Deletes) => lock_prefix.to_string(),
            };
            match watching.take() {
                Some((watched, mut stream)) if watched == target => {
                    let until = async {
                        match deadline {
                            Some(d) => {
                                tokio::time::sleep_until(d.min(Instant::now() + recheck)).await
                            }
                            None => tokio::time::sleep(recheck).await,
                        }
                    };
                    tokio::select! {
                        woke = wait_delete(&mut stream) => {
                            if woke {
                                self.watch_events.fetch_add(1, Ordering::Relaxed);
                            } else {
                                tokio::time::sleep(RETRY_PAUSE).await;
                            }
                        }
                        // Look again now and then, on the same watch.
                        _ = until => {
                            recheck = (recheck * 2).min(RECHECK);
                            watching = Some((watched, stream));
                        }
                    }
                }
                _ => {
                    let options = if target == lock_prefix {
                        WatchOptions::new().with_prefix()
                    } else {
                        WatchOptions::new()
                    };
                    match self
                        .open_watch(&target, options.with_filters([WatchFilterType::NoPut]))
                        .await
                    {
                        Some(stream) => {
                            recheck = FIRST_RECHECK;
                            watching = Some((target, stream));
                        }
                        // No watch: poll.
                        None => tokio::time::sleep(RETRY_PAUSE).await,
                    }
                }
            }
            read_at = Instant::now();
            queue = self.queue(lock_prefix).await?;
        }
    }

    /// Opens a watch from the current revision and waits until the server
    /// confirms it; `None` if that fails.
    pub(crate) async fn open_watch(&self, key: &str, options: WatchOptions) -> Option<WatchStream> {
        let open = async {
            let mut stream = self.client.clone().watch(key, Some(options)).await.ok()?;
            loop {
                let resp = stream.message().await.ok()??;
                if resp.canceled() {
                    return None;
                }
                if resp.created() {
                    return Some(stream);
                }
            }
        };
        tokio::time::timeout(self.options.request_timeout, open)
            .await
            .ok()
            .flatten()
    }

    /// Deletes holds nobody renewed within their TTL, retries orphans, revokes
    /// leases given up on.
    pub(crate) async fn sweep(&self) {
        let now = Instant::now();
        let expired: Vec<String> = {
            lock(&self.holds)
                .remove_where(|h| h.renewed_until <= now)
                .into_iter()
                .map(|h| h.node)
                .collect()
        };
        let orphans = std::mem::take(&mut *lock(&self.orphans));
        for key in expired.into_iter().chain(orphans) {
            self.delete_node(&key).await;
        }
        self.sweep_cancelled(now).await;
        for session in self.sessions() {
            if !lock(&session.dead).is_empty() {
                self.revoke_dead(&session).await;
            }
        }
    }

    /// Deletes keys of dropped acquires whose put landed after the drop's
    /// delete: any key of a `cancelled` name on a live lease of this client
    /// (at most every [`CANCELLED_SWEEP`]). Names of leases no longer alive
    /// are forgotten (a put with a dead lease fails), and so are names older
    /// than [`CANCELLED_WINDOW`] (their names stay reserved).
    pub(crate) async fn sweep_cancelled(&self, now: Instant) {
        {
            let mut last = lock(&self.cancelled_swept);
            if lock(&self.cancelled).is_empty()
                || last.is_some_and(|t| now.duration_since(t) < CANCELLED_SWEEP)
            {
                return;
            }
            *last = Some(now);
        }
        let live: Vec<i64> = self
            .sessions()
            .iter()
            .map(|s| s.lease())
            .filter(|l| l.alive)
            .map(|l| l.id)
            .collect();
        lock(&self.cancelled).retain(|(_, lease, until)| live.contains(lease) && *until > now);
        let leases: HashSet<i64> = lock(&self.cancelled).iter().map(|(_, l, _)| *l).collect();
        for lease in leases {
            let Ok(resp) = self
                .call(|mut c| async move {
                    c.lease_time_to_live(lease, Some(LeaseTimeToLiveOptions::new().with_keys()))
                        .await
                })
                .await
            else {
                continue;
            };
            let ghosts: Vec<String> = {
                let cancelled = lock(&self.cancelled);
                resp.keys()
                    .iter()
                    .map(|k| String::from_utf8_lossy(k).into_owned())
                    .filter(|k| cancelled.iter().any(|(n, _, _)| n == k))
                    .collect()
            };
            for key in ghosts {
                self.delete_node(&key).await;
            }
        }
    }

    /// The TTL a hold of `ttl` gets on `lease`, counted from `from`: never
    /// beyond the lease's own validity.
    pub(crate) fn grant_ttl(
        &self,
        ttl: Duration,
        lease: &session::Lease,
        from: Instant,
    ) -> Option<Duration> {
        let left = lease.valid_until.checked_duration_since(from)?;
        (lease.alive && !left.is_zero()).then(|| ttl.min(left))
    }

    pub(crate) fn lease_overdue(&self) -> Error {
        Error::connection(
            NAME,
            &self.address,
            "the etcd lease's keepalives are overdue; its holds may be about to expire",
        )
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Revoking the leases deletes every key of this client at once.
        let leases: Vec<i64> = self
            .sessions()
            .iter()
            .map(|s| s.lease())
            .filter(|l| l.alive)
            .map(|l| l.id)
            .collect();
        if !leases.is_empty()
            && let Ok(h) = tokio::runtime::Handle::try_current()
        {
            let mut c = self.client.clone();
            let wait = self.options.request_timeout;
            h.spawn(fencelock_core::backend::tracked(async move {
                for id in leases {
                    let _ = tokio::time::timeout(wait, c.lease_revoke(id)).await;
                }
            }));
        }
    }
}

/// Waits for a deletion on `stream`: `true` when one came, `false` if the
/// watch ended.
pub(crate) async fn wait_delete(stream: &mut WatchStream) -> bool {
    loop {
        match stream.message().await {
            Ok(Some(resp)) => {
                if resp
                    .events()
                    .iter()
                    .any(|e| e.event_type() == EventType::Delete)
                {
                    return true;
                }
                if resp.canceled() {
                    return false;
                }
            }
            Ok(None) | Err(_) => return false,
        }
    }
}

/// The read of a lock's queue: every key under its prefix, oldest first.
pub(crate) fn range() -> GetOptions {
    GetOptions::new()
        .with_prefix()
        .with_sort(SortTarget::Create, SortOrder::Ascend)
}

/// The direct children of `lock_prefix` in a range read.
pub(crate) fn nodes(lock_prefix: &str, resp: &GetResponse) -> Vec<Node> {
    resp.kvs()
        .iter()
        .filter_map(|kv| {
            queue::parse(
                lock_prefix,
                kv.key(),
                kv.value(),
                kv.create_revision(),
                kv.lease(),
            )
        })
        .collect()
}
