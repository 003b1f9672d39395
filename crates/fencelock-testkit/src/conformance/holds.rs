//! Tokens and holds: fencing tokens rise, reentrant holds count, a stolen hold is not reentered, a late grant arrives valid, mixed TTLs keep the longest.

use super::*;

pub(super) async fn tokens_increase_across_holders(cx: &Ctx) -> CaseResult {
    let lockers = [cx.locker().await?, cx.locker().await?];
    let key = cx.key("k");
    let mut last = None;
    for i in 0..6 {
        let g = lockers[i % 2].lock(&key).acquire().await?;
        let t = g.token();
        ensure!(t.is_some(), "no token from a fencing backend");
        ensure!(t > last, "token {t:?} after {last:?}");
        last = t;
        g.release().await?;
    }
    Ok(())
}

pub(super) async fn reentrant_holds_count(cx: &Ctx) -> CaseResult {
    let (a, b) = (cx.locker().await?, cx.locker().await?);
    let key = cx.key("k");
    let owner = format!("{}owner", cx.prefix).replace('/', "-");
    let g1 = a.lock(&key).owner(&owner).acquire().await?;
    let g2 = a
        .lock(&key)
        .owner(&owner)
        .wait(Duration::ZERO)
        .acquire()
        .await?;
    ensure!(
        g1.holds() == 1 && g2.holds() == 2,
        "hold counts {} and {}",
        g1.holds(),
        g2.holds()
    );
    let rise = cx.harness.reentrant_token_may_rise();
    ensure!(
        g1.token() == g2.token() || rise && g2.token() > g1.token(),
        "reentrant token changed: {:?} → {:?}",
        g1.token(),
        g2.token()
    );
    ensure!(
        b.lock(&key).try_acquire().await?.is_none(),
        "another owner got a reentrant-held lock"
    );
    g1.release().await?;
    ensure!(
        b.lock(&key).try_acquire().await?.is_none(),
        "freed after one of two releases"
    );
    g2.release().await?;
    let g3 = b.lock(&key).try_acquire().await?;
    ensure!(g3.is_some(), "still held after both releases");
    Ok(())
}

/// A waiter that waited (in the server, or in a queue) for longer than its
/// TTL must be valid on arrival, and stay valid while renewed: its lease
/// counts from when the backend granted it, not from when it started to wait.
pub(super) async fn a_grant_after_a_wait_longer_than_the_ttl_is_held(cx: &Ctx) -> CaseResult {
    let (a, b) = (cx.locker().await?, cx.locker().await?);
    let key = cx.key("k");
    let held = a.lock(&key).ttl(cx.ttl).acquire().await?;
    let waiting = tokio::spawn({
        let (b, key, ttl, wait) = (b.clone(), key.clone(), cx.ttl, cx.soon() + cx.ttl * 3);
        async move { b.lock(&key).ttl(ttl).wait(wait).acquire().await }
    });
    // The holder renews for three TTLs while the other waits.
    tokio::time::sleep(cx.ttl * 3).await;
    ensure!(held.is_valid(), "the holder lost its renewed lease");
    held.release().await?;
    let g = waiting
        .await
        .map_err(|e| Fail(format!("the waiter panicked: {e}")))??;
    ensure!(
        g.is_valid(),
        "granted after a wait of 3 × TTL, but lost on arrival: {:?}",
        g.lease().lost_reason()
    );
    tokio::time::sleep(cx.ttl * 2).await;
    ensure!(
        g.is_valid(),
        "granted after a long wait, then lost while renewed: {:?}",
        g.lease().lost_reason()
    );
    g.release().await?;
    Ok(())
}

/// Two holds of one owner with different TTLs: renewing the short one must not
/// cut the long one's expiry, so the key stays held after the short one goes.
pub(super) async fn mixed_ttl_reentrant_holds_keep_the_longest(cx: &Ctx) -> CaseResult {
    let (a, b) = (cx.locker().await?, cx.locker().await?);
    let key = cx.key("k");
    let owner = format!("{}mixed", cx.prefix).replace('/', "-");
    let (long, short) = (cx.ttl * 20, cx.ttl);
    let g1 = a.lock(&key).owner(&owner).ttl(long).acquire().await?;
    let g2 = a
        .lock(&key)
        .owner(&owner)
        .ttl(short)
        .wait(Duration::ZERO)
        .acquire()
        .await?;
    // The watchdog renews the short hold a few times, then it goes.
    tokio::time::sleep(short * 2).await;
    g2.release().await?;
    // Well past the short TTL, within the long one.
    tokio::time::sleep(short * 3).await;
    ensure!(
        g1.is_valid(),
        "the long hold is no longer valid after the short one went: {:?}",
        g1.lease().lost_reason()
    );
    ensure!(
        b.lock(&key).try_acquire().await?.is_none(),
        "another client got the lock while the long hold (ttl {long:?}) was valid for {:?} more",
        g1.lease().time_left()
    );
    g1.release().await?;
    let g3 = b.lock(&key).wait(cx.soon()).acquire().await?;
    g3.release().await?;
    Ok(())
}
