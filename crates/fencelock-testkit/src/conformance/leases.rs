//! Leases: TTL expiry, the watchdog, fixed leases, max_hold, the lost signal.

use super::*;

pub(super) async fn ttl_frees_a_leaked_guard(cx: &Ctx) -> CaseResult {
    let (a, b) = (cx.locker().await?, cx.locker().await?);
    let key = cx.key("k");
    let g = a.lock(&key).ttl(cx.ttl).acquire().await?;
    let first = g.token();
    let start = Instant::now();
    let _ = g.leak();
    ensure!(
        b.lock(&key).try_acquire().await?.is_none(),
        "a leaked lock was free at once"
    );
    let g2 = b.lock(&key).wait(cx.soon()).acquire().await?;
    let took = start.elapsed();
    ensure!(
        took >= cx.ttl / 2,
        "freed after {took:?}, well before the TTL {:?}",
        cx.ttl
    );
    if cx.caps.fencing {
        ensure!(
            g2.token() > first,
            "token {:?} after {:?}",
            g2.token(),
            first
        );
    }
    g2.release().await?;
    Ok(())
}

pub(super) async fn watchdog_keeps_lock_past_3x_ttl(cx: &Ctx) -> CaseResult {
    let (a, b) = (cx.locker().await?, cx.locker().await?);
    let key = cx.key("k");
    let g = a.lock(&key).ttl(cx.ttl).acquire().await?;
    tokio::time::sleep(cx.ttl * 7 / 2).await;
    ensure!(g.is_valid(), "the guard is no longer valid after 3.5 × ttl");
    ensure!(
        b.lock(&key).try_acquire().await?.is_none(),
        "another client got the lock the watchdog keeps"
    );
    g.release().await?;
    Ok(())
}

pub(super) async fn fixed_lease_expires_and_fires_lost(cx: &Ctx) -> CaseResult {
    let (a, b) = (cx.locker().await?, cx.locker().await?);
    let key = cx.key("k");
    let start = Instant::now();
    let g = a.lock(&key).lease(cx.ttl).acquire().await?;
    let lost = tokio::time::timeout(cx.soon(), g.lost())
        .await
        .map_err(|_| Fail("lost() did not fire for a fixed lease".into()))?;
    ensure!(
        matches!(
            lost,
            Error::Lost {
                reason: LostReason::Expired,
                ..
            }
        ),
        "expected Lost(Expired), got {lost:?}"
    );
    ensure!(
        start.elapsed() >= cx.ttl / 2,
        "a fixed lease was lost after {:?}",
        start.elapsed()
    );
    ensure!(!g.is_valid(), "is_valid() after lost()");
    let g2 = b.lock(&key).wait(cx.soon()).acquire().await?;
    g2.release().await?;
    Ok(())
}

pub(super) async fn max_hold_stops_renewal(cx: &Ctx) -> CaseResult {
    let (a, b) = (cx.locker().await?, cx.locker().await?);
    let key = cx.key("k");
    let g = a.lock(&key).ttl(cx.ttl).max_hold(cx.ttl).acquire().await?;
    let lost = tokio::time::timeout(cx.soon(), g.lost())
        .await
        .map_err(|_| Fail("lost() did not fire after max_hold".into()))?;
    ensure!(
        matches!(
            lost,
            Error::Lost {
                reason: LostReason::MaxHold,
                ..
            }
        ),
        "expected Lost(MaxHold), got {lost:?}"
    );
    let g2 = b.lock(&key).wait(cx.soon()).acquire().await?;
    g2.release().await?;
    Ok(())
}

pub(super) async fn lost_fires_when_lease_is_stolen(cx: &Ctx) -> CaseResult {
    let (a, b, c) = (cx.locker().await?, cx.locker().await?, cx.locker().await?);
    let key = cx.key("k");
    let g = a.lock(&key).ttl(cx.ttl).acquire().await?;
    cx.harness.steal(&Key::new(&key)?).await?;
    let lost = tokio::time::timeout(cx.soon(), g.lost())
        .await
        .map_err(|_| Fail("lost() did not fire after the lease was deleted".into()))?;
    ensure!(
        matches!(
            lost,
            Error::Lost {
                reason: LostReason::NotHeld(_) | LostReason::SessionEnded(_),
                ..
            }
        ),
        "expected Lost(NotHeld), got {lost:?}"
    );
    ensure!(!g.is_valid(), "is_valid() after lost()");
    let g2 = b.lock(&key).wait(cx.soon()).acquire().await?;
    // The old holder's release must not free the new holder's lock.
    let r = g.release().await;
    ensure!(
        matches!(r, Err(Error::NotHeld { .. })),
        "stale release: expected NotHeld, got {r:?}"
    );
    ensure!(
        c.lock(&key).try_acquire().await?.is_none(),
        "a stale release freed the new holder's lock"
    );
    g2.release().await?;
    Ok(())
}

pub(super) async fn lost_fires_when_renewal_fails(cx: &Ctx) -> CaseResult {
    let (a, flaky) = cx.client().await?;
    let key = cx.key("k");
    let g = a.lock(&key).ttl(cx.ttl).acquire().await?;
    flaky.fail_renewals(true);
    let start = Instant::now();
    let lost = tokio::time::timeout(cx.soon(), g.lost())
        .await
        .map_err(|_| Fail("lost() did not fire while renewals failed".into()))?;
    ensure!(
        matches!(
            lost,
            Error::Lost {
                reason: LostReason::RenewFailed(_),
                ..
            }
        ),
        "expected Lost(RenewFailed), got {lost:?}"
    );
    ensure!(
        start.elapsed() <= cx.ttl + Duration::from_secs(2),
        "lost() fired {:?} after renewals began to fail (ttl {:?})",
        start.elapsed(),
        cx.ttl
    );
    ensure!(!g.is_valid(), "is_valid() after lost()");
    flaky.fail_renewals(false);
    // Never silently re-acquired: the guard stays lost even though renewals work again.
    tokio::time::sleep(cx.ttl / 2).await;
    ensure!(!g.is_valid(), "a lost guard became valid again");
    drop(g);
    Ok(())
}

pub(super) async fn run_cancels_closure_on_lost(cx: &Ctx) -> CaseResult {
    let a = cx.locker().await?;
    let key = cx.key("k");
    let finished = Arc::new(AtomicBool::new(false));
    let (harness, k) = (cx.harness.clone(), Key::new(&key)?);
    let thief = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(200)).await;
        harness.steal(&k).await
    });
    let f = finished.clone();
    let long = cx.soon() * 2;
    let start = Instant::now();
    let r = a
        .lock(&key)
        .ttl(cx.ttl)
        .run(|_lease| async move {
            tokio::time::sleep(long).await;
            f.store(true, Ordering::SeqCst);
        })
        .await;
    thief.await.map_err(|e| Fail(e.to_string()))??;
    ensure!(
        matches!(r, Err(Error::Lost { .. })),
        "expected Lost, got {r:?}"
    );
    ensure!(
        !finished.load(Ordering::SeqCst),
        "the closure ran to its end after the lease was lost"
    );
    ensure!(
        start.elapsed() < long,
        "run() returned only after the closure's own time"
    );
    Ok(())
}

/// An owner name is not a hold: when an operator breaks a hold taken with an
/// explicit owner and that owner takes the key again (a restarted process
/// that names itself by host, or the same process, whose reentrant acquire
/// must then make a new hold, with a larger token), the first guard must find
/// its lease lost and its release must leave the new hold alone — renewals
/// and releases match the grant, not the owner's name.
pub(super) async fn a_stale_guard_of_the_same_owner_leaves_the_new_hold_alone(
    cx: &Ctx,
) -> CaseResult {
    let (a, b) = (cx.locker().await?, cx.locker().await?);
    stale_guard_round(cx, &a, &b, "another client").await?;
    stale_guard_round(cx, &a, &a, "the same client").await
}

async fn stale_guard_round(cx: &Ctx, a: &Locker, b: &Locker, who: &str) -> CaseResult {
    let c = cx.locker().await?;
    let key = cx.key(&format!("k-{}", who.replace(' ', "-")));
    let owner = "host-1";
    let old = a.lock(&key).owner(owner).ttl(cx.ttl).acquire().await?;
    cx.harness.steal(&Key::new(&key)?).await?;
    // Retaken at once, before the old guard's next renewal is due.
    let new = b
        .lock(&key)
        .owner(owner)
        .ttl(cx.ttl)
        .wait(cx.soon())
        .acquire()
        .await?;
    if cx.caps.fencing {
        ensure!(
            new.token() > old.token(),
            "retaken by {who}: the new hold got token {:?}, the broken one had {:?}",
            new.token(),
            old.token()
        );
    }
    tokio::time::timeout(cx.soon(), old.lost())
        .await
        .map_err(|_| {
            Fail(format!(
                "retaken by {who}: the broken guard was still valid {:?} after its hold was broken and retaken by the same owner (its renewals extend the new hold)",
                cx.soon()
            ))
        })?;
    let r = old.release().await;
    ensure!(
        matches!(r, Err(Error::NotHeld { .. })),
        "retaken by {who}: the broken guard's release: expected NotHeld, got {r:?}"
    );
    ensure!(
        c.lock(&key).try_acquire().await?.is_none(),
        "retaken by {who}: the broken guard's release freed the same owner's new hold"
    );
    ensure!(
        new.is_valid(),
        "retaken by {who}: the new hold was lost: {:?}",
        new.lease().lost_reason()
    );
    new.release().await?;
    Ok(())
}
