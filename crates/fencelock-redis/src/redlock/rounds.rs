//! The rounds of the protocol: one operation sent to every instance, decided
//! on a majority (acquire, release with handoff), undone where it did not
//! reach one.

use super::*;

impl RedlockBackend {
    /// Runs `f(index, node)` on every instance in parallel, each bounded by
    /// `timeout`; with [`Skip::Down`] an instance that failed within
    /// [`DOWN_FOR`] is skipped.
    pub(super) async fn on_all<'a, T, F, Fut>(
        &'a self,
        timeout: Duration,
        skip: Skip,
        f: F,
    ) -> Vec<Answer<T>>
    where
        F: Fn(usize, &'a Node) -> Fut,
        Fut: Future<Output = Result<T>> + 'a,
    {
        let f = &f;
        let inner = &*self.inner;
        join_all(
            (0..inner.instances.len())
                .map(|i| inner.run_on(i, timeout, skip, move |node| f(i, node))),
        )
        .await
    }

    /// Runs `op` on every instance in parallel and returns as soon as a
    /// majority answered with `success` (or everyone answered). The calls still
    /// running are moved to a background task, so every instance gets the
    /// request and its reply is handled (a late grant is renewed and released
    /// like the others).
    ///
    /// `out` holds answers already had (of a lead instance asked first); the
    /// instances without one are asked.
    pub(super) async fn on_quorum(
        &self,
        timeout: Duration,
        op: Arc<Call>,
        success: fn(&OpAnswer) -> bool,
        mut out: Vec<Option<Answer<OpAnswer>>>,
    ) -> Vec<Option<Answer<OpAnswer>>> {
        use futures::stream::{FuturesUnordered, StreamExt};
        let n = self.inner.instances.len();
        let skip = match *op {
            Call::Acquire(..) => Skip::Down,
            Call::Release(..) => Skip::Never,
        };
        let mut calls: FuturesUnordered<_> = (0..n)
            .filter(|&i| out[i].is_none())
            .map(|i| {
                let (inner, op) = (self.inner.clone(), op.clone());
                async move { (i, inner.run_on(i, timeout, skip, |node| op.run(node)).await) }
            })
            .collect();
        let mut ok = out
            .iter()
            .filter(|a| matches!(a, Some(Answer::Ok(a)) if success(a)))
            .count();
        while let Some((i, answer)) = calls.next().await {
            if matches!(&answer, Answer::Ok(a) if success(a)) {
                ok += 1;
            }
            out[i] = Some(answer);
            if ok >= self.quorum() {
                break;
            }
        }
        if !calls.is_empty() {
            tokio::spawn(async move { while calls.next().await.is_some() {} });
        }
        out
    }

    pub(super) fn no_quorum<'a, T: 'a>(
        &self,
        ok: usize,
        answers: impl IntoIterator<Item = &'a Answer<T>>,
    ) -> Error {
        let failed: Vec<String> = answers
            .into_iter()
            .filter_map(|a| a.error().map(ToString::to_string))
            .collect();
        Error::connection(
            NAME,
            &self.inner.address,
            format!(
                "no quorum: {ok} of {} instances agreed, a majority is {}; {} failed ({})",
                self.inner.instances.len(),
                self.quorum(),
                failed.len(),
                failed.first().cloned().unwrap_or_default()
            ),
        )
    }

    /// Undoes op `op` of `owner` on the instances listed in `on`: what it
    /// granted (an acquire) or handed over (a release) is taken back, nothing
    /// else, and should it reach an instance later it grants nothing there.
    pub(super) async fn undo(
        &self,
        key: &Key,
        owner: &str,
        op: &Op,
        on: &[usize],
        timeout: Duration,
    ) {
        if on.is_empty() {
            return;
        }
        let _ = self
            .on_all(timeout, Skip::Never, |i, n| async move {
                if on.contains(&i) {
                    n.undo(key, owner, op).await.map(|_| ())
                } else {
                    Ok(())
                }
            })
            .await;
    }

    /// One Redlock round, as one op on every instance. Undone on every
    /// instance that granted (or may have) unless it reaches a majority in
    /// time; undone in the background if the caller drops it.
    ///
    /// `lead_first` (a waiter's rounds, but for one a second when it hears of
    /// no release): the first instance that has not failed lately is asked
    /// alone first, and the others only if it grants. Waiters that all ask it
    /// first cannot split the votes: it
    /// picks one, whose requests to the others then meet no rival. A refusal
    /// there ends the round. A lead that fails is marked down and the round
    /// goes on without it, as any round does (what the op may have done there
    /// is undone with the rest if the round fails, and released with the lease
    /// if it succeeds).
    pub(super) async fn attempt(&self, req: &Request, lead_first: bool) -> Result<Round> {
        let start = Instant::now();
        let timeout = self.timeout_for(Some(req.ttl));
        let proposal = self.propose();
        let pending = Pending {
            backend: Some(self.clone()),
            key: req.key.clone(),
            owner: req.owner.to_string(),
            op: self.inner.ops.next(),
        };
        let call = Arc::new(Call::Acquire(req.clone(), proposal, pending.op.clone()));
        let n = self.inner.instances.len();
        let mut had: Vec<Option<Answer<OpAnswer>>> = (0..n).map(|_| None).collect();
        if lead_first
            && let Some(lead) = (0..n).find(|&i| {
                let inst = &self.inner.instances[i];
                inst.is_down().is_none() && inst.may_lead()
            })
        {
            let answer = self
                .inner
                .run_on(lead, timeout, Skip::Down, |node| call.run(node))
                .await;
            match answer {
                Answer::Ok(OpAnswer::Acquire(Attempt::Busy { left, server_us })) => {
                    self.observe([server_us]);
                    pending.settle();
                    return Ok(Round::Busy {
                        hint: left,
                        split: false,
                    });
                }
                granted @ Answer::Ok(OpAnswer::Acquire(Attempt::Granted { .. })) => {
                    had[lead] = Some(granted);
                }
                // Failed (marked down: skipped below) or an error answer
                // (asked again below: the op acts once).
                _ => {}
            }
        }
        let answers = self
            .on_quorum(
                timeout,
                call,
                |a| matches!(a, OpAnswer::Acquire(Attempt::Granted { .. })),
                had,
            )
            .await;
        let mut granted = Vec::new();
        let mut busy = 0;
        let mut hint = Duration::MAX;
        let mut readings = Vec::new();
        for a in answers.iter() {
            match a {
                Some(Answer::Ok(OpAnswer::Acquire(Attempt::Granted {
                    token,
                    holds,
                    server_us,
                    ..
                }))) => {
                    granted.push((*token, *holds));
                    readings.push(*server_us);
                }
                Some(Answer::Ok(OpAnswer::Acquire(Attempt::Busy { left, server_us }))) => {
                    busy += 1;
                    hint = hint.min(*left);
                    readings.push(*server_us);
                }
                Some(Answer::Failed(Error::InvalidConfig(m))) => {
                    return Err(Error::InvalidConfig(m.clone()));
                }
                _ => {}
            }
        }
        self.observe(readings);
        let valid = |at: Instant| at.duration_since(start) + drift_allowance(req.ttl) < req.ttl;
        if granted.len() >= self.quorum() && valid(Instant::now()) {
            // The largest answer, also for a reentrant acquire: an instance's
            // hold of the owner may be one a release missed (older than
            // another owner's grant since), so its token alone could be too
            // small; an instance that grants anew answers above every earlier
            // grant it saw.
            let tokens: Vec<u64> = granted.iter().map(|(t, _)| *t).collect();
            if let Some(token) = self.settle_token(req, &pending.op, &tokens, timeout).await
                && valid(Instant::now())
            {
                let holds = granted.iter().map(|(_, h)| *h).max().unwrap_or(1);
                let grant = Grant::new(Some(FencingToken::new(token)), req.ttl, holds, start)
                    .with_handle(pending.op.as_str());
                pending.settle();
                return Ok(Round::Granted(grant));
            }
        }
        // Not granted: undo the op wherever it granted or may have run.
        let undo: Vec<usize> = answers
            .iter()
            .enumerate()
            .filter(|(_, a)| {
                !matches!(a, Some(Answer::Ok(OpAnswer::Acquire(Attempt::Busy { .. }))))
            })
            .map(|(i, _)| i)
            .collect();
        self.undo(&req.key, req.owner.as_str(), &pending.op, &undo, timeout)
            .await;
        pending.settle();
        if granted.len() + busy < self.quorum() {
            let slow = answers.iter().any(|a| matches!(a, Some(Answer::Late(_))));
            let error = self.no_quorum(granted.len() + busy, answers.iter().flatten());
            return Ok(Round::NoQuorum { error, slow });
        }
        Ok(Round::Busy {
            hint: if hint == Duration::MAX {
                RETRY_DELAY
            } else {
                hint
            },
            split: !granted.is_empty(),
        })
    }

    /// Releases `lease` on every instance; with `next`, each instance that lets
    /// the lock go hands it to `next` in the same script. The handoff counts if
    /// a majority handed it over within the validity (its token settled as for
    /// an acquire); otherwise it is undone and `next` waits on as usual.
    pub(super) async fn release_on_all(
        &self,
        lease: &LeaseRef,
        next: Option<&Request>,
    ) -> Result<(Released, Option<Grant>)> {
        let start = Instant::now();
        // A handoff must settle within the next holder's validity too.
        let ttl = next.map_or(lease.ttl, |n| n.ttl.min(lease.ttl));
        let timeout = self.timeout_for(Some(ttl));
        let proposal = if next.is_some() { self.propose() } else { 0 };
        let op = self.inner.ops.next();
        let call = Call::Release(lease.clone(), next.cloned(), proposal, op.clone());
        // With a handoff, a majority must hand over; without, a majority must answer.
        let success: fn(&OpAnswer) -> bool = if next.is_some() {
            |a| matches!(a, OpAnswer::Release(_, handed, _) if *handed > 0)
        } else {
            |a| matches!(a, OpAnswer::Release(..))
        };
        let none = (0..self.inner.instances.len()).map(|_| None).collect();
        let answers = self.on_quorum(timeout, Arc::new(call), success, none).await;
        self.observe(answers.iter().filter_map(|a| match a {
            Some(Answer::Ok(OpAnswer::Release(_, _, at))) => Some(*at),
            _ => None,
        }));
        let left: Vec<i64> = answers
            .iter()
            .filter_map(|a| match a {
                Some(Answer::Ok(OpAnswer::Release(left, _, _))) => Some(*left),
                _ => None,
            })
            .collect();
        if left.is_empty() {
            // The handoff may have run where no answer came: undo it (a late
            // release then lets go without handing over).
            if let Some(next) = next {
                let all: Vec<usize> = (0..self.inner.instances.len()).collect();
                self.undo(&next.key, next.owner.as_str(), &op, &all, timeout)
                    .await;
            }
            return Err(self.no_quorum(0, answers.iter().flatten()));
        }
        let released = match left.iter().copied().max() {
            Some(l) if l >= 0 => Released::new(l as u32),
            _ => {
                return Err(Error::NotHeld {
                    key: lease.key.to_string(),
                    owner: lease.owner.to_string(),
                });
            }
        };
        let Some(next) = next else {
            return Ok((released, None));
        };
        let handed: Vec<(usize, u64)> = answers
            .iter()
            .enumerate()
            .filter_map(|(i, a)| match a {
                Some(Answer::Ok(OpAnswer::Release(_, t, _))) if *t > 0 => Some((i, *t)),
                _ => None,
            })
            .collect();
        if handed.is_empty() {
            return Ok((released, None));
        }
        let valid = start.elapsed() + drift_allowance(next.ttl) < next.ttl;
        if handed.len() >= self.quorum() && valid {
            let tokens: Vec<u64> = handed.iter().map(|(_, t)| *t).collect();
            if let Some(token) = self.settle_token(next, &op, &tokens, timeout).await {
                return Ok((
                    released,
                    Some(
                        Grant::new(Some(FencingToken::new(token)), next.ttl, 1, start)
                            .with_handle(op.as_str()),
                    ),
                ));
            }
        }
        // Undo the handoff wherever it happened or may still happen; the
        // release itself stands.
        let on: Vec<usize> = answers
            .iter()
            .enumerate()
            .filter(|(_, a)| !matches!(a, Some(Answer::Ok(OpAnswer::Release(_, 0, _)))))
            .map(|(i, _)| i)
            .collect();
        self.undo(&next.key, next.owner.as_str(), &op, &on, timeout)
            .await;
        Ok((released, None))
    }

    pub(super) async fn watches(&self, key: &Key) -> Vec<Watch> {
        let answers = self
            .on_all(self.timeout_for(None), Skip::Down, |_, n| n.watch(key))
            .await;
        answers
            .into_iter()
            .filter_map(|a| match a {
                Answer::Ok(w) => Some(w),
                _ => None,
            })
            .collect()
    }
}
