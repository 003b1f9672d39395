//! Shared, semaphore and multi-lock modes, and inspection.

use super::*;

pub(super) async fn readers_coexist_and_exclude_writers(cx: &Ctx) -> CaseResult {
    let (a, b, c) = (cx.locker().await?, cx.locker().await?, cx.locker().await?);
    let key = cx.key("k");
    let r1 = a.read_lock(&key).acquire().await?;
    let r2 = b.read_lock(&key).wait(Duration::ZERO).acquire().await?;
    ensure!(
        c.lock(&key).try_acquire().await?.is_none(),
        "a writer got in beside readers"
    );
    let k = key.clone();
    let writer =
        tokio::spawn(async move { c.lock(&k).wait(Duration::from_secs(20)).acquire().await });
    r1.release().await?;
    tokio::time::sleep(Duration::from_millis(100)).await;
    ensure!(
        !writer.is_finished(),
        "a writer got in while a reader still held"
    );
    r2.release().await?;
    let w = writer.await.map_err(|e| Fail(e.to_string()))??;
    ensure!(
        a.read_lock(&key).try_acquire().await?.is_none(),
        "a reader got in beside a writer"
    );
    w.release().await?;
    ensure!(
        a.read_lock(&key).try_acquire().await?.is_some(),
        "a reader was refused a free lock"
    );
    Ok(())
}

pub(super) async fn semaphore_admits_exactly_n(cx: &Ctx) -> CaseResult {
    const N: u32 = 3;
    let key = cx.key("k");
    let mut holders = Vec::new();
    for _ in 0..N {
        let l = cx.locker().await?;
        let g = l.semaphore(&key, N).try_acquire().await?;
        ensure!(g.is_some(), "permit {} of {N} refused", holders.len() + 1);
        holders.push(g);
    }
    let extra = cx.locker().await?;
    ensure!(
        extra.semaphore(&key, N).try_acquire().await?.is_none(),
        "permit {} of {N} granted",
        N + 1
    );
    ensure!(
        extra.lock(&key).try_acquire().await?.is_none(),
        "an exclusive lock beside semaphore holders"
    );
    if cx.caps.fencing {
        let mut tokens: Vec<_> = holders.iter().flatten().map(Guard::token).collect();
        tokens.dedup();
        ensure!(
            tokens.len() == N as usize,
            "permit holders share tokens: {tokens:?}"
        );
    }
    if let Some(Some(g)) = holders.pop() {
        g.release().await?;
    }
    ensure!(
        extra.semaphore(&key, N).try_acquire().await?.is_some(),
        "a released permit was not available"
    );
    Ok(())
}

/// A key has one permit count while held: the first holder's count fixes it,
/// a request with another count is refused at once with a clear error, the
/// same count still shares the permits, and a free key takes a new count.
pub(super) async fn a_semaphore_keeps_one_permit_count_while_held(cx: &Ctx) -> CaseResult {
    let (a, b) = (cx.locker().await?, cx.locker().await?);
    let key = cx.key("k");
    let first = a.semaphore(&key, 2).acquire().await?;
    for asked in [1, 3] {
        match b.semaphore(&key, asked).wait(cx.soon()).acquire().await {
            Err(Error::InvalidConfig(msg)) => ensure!(
                msg.contains("permits"),
                "the refusal does not say why: {msg}"
            ),
            Ok(g) => {
                let _ = g.release().await;
                return Err(Fail(format!(
                    "a semaphore held with 2 permits granted a request for {asked}"
                )));
            }
            Err(e) => {
                return Err(Fail(format!(
                    "a request for {asked} permits of a 2-permit semaphore: {e}"
                )));
            }
        }
    }
    let second = b
        .semaphore(&key, 2)
        .try_acquire()
        .await?
        .ok_or_else(|| Fail("the second of 2 permits was refused".into()))?;
    first.release().await?;
    second.release().await?;
    let g = b.semaphore(&key, 3).wait(cx.soon()).acquire().await?;
    g.release().await?;
    Ok(())
}

pub(super) async fn multi_lock_is_all_or_nothing(cx: &Ctx) -> CaseResult {
    let (a, b) = (cx.locker().await?, cx.locker().await?);
    let keys = [cx.key("c"), cx.key("a"), cx.key("b")];
    let blocker = b.lock(&keys[2]).acquire().await?;
    let r = a
        .multi_lock(&keys)
        .wait(Duration::from_millis(300))
        .acquire()
        .await;
    ensure!(
        matches!(r, Err(Error::Timeout { .. })),
        "expected Timeout, got {r:?}"
    );
    for k in [&keys[0], &keys[1]] {
        ensure!(
            b.lock(k).try_acquire().await?.is_some(),
            "{k} stayed held after the multi-lock failed"
        );
    }
    blocker.release().await?;
    let all = a
        .multi_lock(&keys)
        .wait(Duration::from_secs(20))
        .acquire()
        .await?;
    ensure!(
        all.guards().len() == 3,
        "multi-lock holds {} keys",
        all.guards().len()
    );
    for k in &keys {
        ensure!(
            b.lock(k).try_acquire().await?.is_none(),
            "{k} free while the multi-lock holds it"
        );
    }
    all.release().await?;
    Ok(())
}

pub(super) async fn inspect_shows_the_holder(cx: &Ctx) -> CaseResult {
    let a = cx.locker().await?;
    let key = cx.key("k");
    let g = a.lock(&key).acquire().await?;
    let info = a
        .inspect(&key)
        .await?
        .ok_or_else(|| Fail("inspect found nothing".into()))?;
    ensure!(
        info.holders.len() == 1,
        "inspect shows {} holders",
        info.holders.len()
    );
    let h = &info.holders[0];
    ensure!(
        h.owner == g.owner().as_str(),
        "inspect shows owner {:?}, not {:?}",
        h.owner,
        g.owner()
    );
    ensure!(
        h.mode == Mode::Exclusive && h.holds == 1,
        "inspect shows {h:?}"
    );
    ensure!(
        h.token == g.token(),
        "inspect shows token {:?}, the guard has {:?}",
        h.token,
        g.token()
    );
    let listed = a.list(&cx.prefix).await?;
    ensure!(
        listed.iter().any(|i| i.key == key),
        "list({:?}) misses {key}",
        cx.prefix
    );
    g.release().await?;
    let after = a.inspect(&key).await?;
    ensure!(
        after.as_ref().is_none_or(|i| i.holders.is_empty()),
        "inspect after release shows {after:?}"
    );
    Ok(())
}

/// Two shared acquires of one explicit owner at once on one client may both
/// pass the reentry check and be granted by two grants: each guard must keep
/// its own (renewed, valid, released), and once both are released a writer
/// must get the key.
pub(super) async fn racing_shared_holds_of_one_owner_keep_their_grants(cx: &Ctx) -> CaseResult {
    let (a, b) = (cx.locker().await?, cx.locker().await?);
    let key = cx.key("k");
    let take = || {
        a.read_lock(&key)
            .owner("host-1")
            .ttl(cx.ttl)
            .wait(cx.soon())
            .acquire()
    };
    let (g1, g2) = tokio::join!(take(), take());
    let (g1, g2) = (g1?, g2?);
    // Several renewal periods.
    tokio::time::sleep(cx.ttl * 2).await;
    for (name, g) in [("first", &g1), ("second", &g2)] {
        ensure!(
            g.is_valid(),
            "the {name} of two racing shared holds of one owner was lost: {:?}",
            g.lease().lost_reason()
        );
    }
    g1.release().await?;
    g2.release().await?;
    let w = b.lock(&key).ttl(cx.ttl).wait(cx.soon()).acquire().await;
    ensure!(
        w.is_ok(),
        "a writer after both shared holds were released: {w:?}"
    );
    w?.release().await?;
    Ok(())
}
