//! The basics: input checked before any I/O, exclusion, waiting and its deadline, releases (dropped, repeated, by a non-owner).

use super::*;

pub(super) async fn bad_input_fails_before_io(cx: &Ctx) -> CaseResult {
    let (locker, flaky) = cx.client().await?;
    let long = "k".repeat(300);
    for (what, key) in [
        ("empty key", ""),
        ("300-byte key", long.as_str()),
        ("key with a newline", "a\nb"),
    ] {
        let r = locker.lock(key).try_acquire().await;
        ensure!(
            matches!(r, Err(Error::InvalidKey { .. })),
            "{what}: expected InvalidKey, got {r:?}"
        );
    }
    let key = cx.key("k");
    let cases: Vec<(&str, Result<Option<Guard>>)> = vec![
        (
            "zero ttl",
            locker.lock(&key).ttl(Duration::ZERO).try_acquire().await,
        ),
        (
            "zero lease",
            locker.lock(&key).lease(Duration::ZERO).try_acquire().await,
        ),
        ("0 permits", locker.semaphore(&key, 0).try_acquire().await),
        (
            "zero max_hold",
            locker
                .lock(&key)
                .max_hold(Duration::ZERO)
                .try_acquire()
                .await,
        ),
        (
            "empty owner",
            locker.lock(&key).owner("").try_acquire().await,
        ),
    ];
    for (what, r) in cases {
        ensure!(
            matches!(r, Err(Error::InvalidConfig(_))),
            "{what}: expected InvalidConfig, got {r:?}"
        );
    }
    let r = locker.multi_lock(["ok", ""]).acquire().await;
    ensure!(
        matches!(r, Err(Error::InvalidKey { .. })),
        "multi-lock with an empty key: got {r:?}"
    );
    let r = locker.inspect("").await;
    ensure!(
        matches!(r, Err(Error::InvalidKey { .. })),
        "inspect of an empty key: got {r:?}"
    );
    ensure!(
        flaky.calls() == 0,
        "bad input reached the backend ({} calls)",
        flaky.calls()
    );
    Ok(())
}

pub(super) async fn exclusion_under_contention(cx: &Ctx) -> CaseResult {
    const TASKS: usize = 32;
    const CLIENTS: usize = 4;
    let key = cx.key("hot");
    let total = cx.harness.contention_cycles().max(TASKS);
    let per_task = total / TASKS;
    let mut lockers = Vec::new();
    for _ in 0..CLIENTS {
        lockers.push(cx.locker().await?);
    }
    let counter = Arc::new(AtomicU64::new(0));
    let holds = Arc::new(Mutex::new(Vec::with_capacity(total)));
    let mut tasks = Vec::new();
    for t in 0..TASKS {
        let locker = lockers[t % CLIENTS].clone();
        let (key, counter, holds, ttl) = (key.clone(), counter.clone(), holds.clone(), cx.ttl);
        tasks.push(tokio::spawn(async move {
            for _ in 0..per_task {
                let g = locker
                    .lock(&key)
                    .ttl(ttl)
                    .wait(Duration::from_secs(120))
                    .acquire()
                    .await?;
                let acquired_ns = Hold::now_ns();
                // An unprotected read-modify-write: only the lock keeps it exact.
                let v = counter.load(Ordering::SeqCst);
                tokio::task::yield_now().await;
                counter.store(v + 1, Ordering::SeqCst);
                let valid = g.is_valid();
                let hold = Hold {
                    holder: format!("task-{t}"),
                    mode: Mode::Exclusive,
                    token: g.token().map(|t| t.get()),
                    acquired_ns,
                    released_ns: Hold::now_ns(),
                };
                holds.lock().unwrap_or_else(|p| p.into_inner()).push(hold);
                g.release().await?;
                if !valid {
                    return Err(Error::backend(
                        "testkit",
                        "a lease was lost during a short hold",
                    ));
                }
            }
            Ok::<(), Error>(())
        }));
    }
    for t in tasks {
        t.await.map_err(|e| Fail(format!("task panicked: {e}")))??;
    }
    let expected = (per_task * TASKS) as u64;
    let got = counter.load(Ordering::SeqCst);
    ensure!(
        got == expected,
        "counter is {got}, expected {expected}: updates were lost"
    );
    let holds = holds.lock().unwrap_or_else(|p| p.into_inner()).clone();
    if cx.caps.fencing {
        ensure!(
            holds.iter().all(|h| h.token.is_some()),
            "a fencing backend granted without a token"
        );
    } else {
        ensure!(
            holds.iter().all(|h| h.token.is_none()),
            "a backend without fencing handed out a token"
        );
    }
    check_history(&holds).map_err(|v| Fail(format!("history violated: {v}")))?;
    Ok(())
}

pub(super) async fn try_once_when_busy(cx: &Ctx) -> CaseResult {
    let (a, b) = (cx.locker().await?, cx.locker().await?);
    let key = cx.key("k");
    let g = a.lock(&key).acquire().await?;
    let r = b.lock(&key).try_acquire().await?;
    ensure!(r.is_none(), "try_acquire got a busy lock");
    let r = b.lock(&key).wait(Duration::ZERO).acquire().await;
    ensure!(
        matches!(r, Err(Error::Timeout { .. })),
        "wait(0) on a busy lock: expected Timeout, got {r:?}"
    );
    g.release().await?;
    let r = b.lock(&key).try_acquire().await?;
    ensure!(r.is_some(), "try_acquire failed on a free lock");
    Ok(())
}

pub(super) async fn wait_timeout_is_an_error_near_the_deadline(cx: &Ctx) -> CaseResult {
    let (a, b) = (cx.locker().await?, cx.locker().await?);
    let key = cx.key("k");
    let _g = a.lock(&key).acquire().await?;
    let wait = Duration::from_millis(400);
    let start = Instant::now();
    let r = b.lock(&key).wait(wait).acquire().await;
    let took = start.elapsed();
    ensure!(
        matches!(r, Err(Error::Timeout { .. })),
        "expected Timeout, got {r:?}"
    );
    ensure!(
        took >= wait,
        "gave up after {took:?}, before the {wait:?} wait"
    );
    let slack = Duration::from_secs(3);
    ensure!(
        took <= wait + slack,
        "gave up after {took:?}, long after the {wait:?} wait"
    );
    Ok(())
}

pub(super) async fn waiter_is_granted_after_release(cx: &Ctx) -> CaseResult {
    let (a, b) = (cx.locker().await?, cx.locker().await?);
    let key = cx.key("k");
    // A long TTL: only the release can free the lock within the wait.
    let g = a.lock(&key).ttl(Duration::from_secs(60)).acquire().await?;
    let first = g.token();
    let k = key.clone();
    let waiter =
        tokio::spawn(async move { b.lock(&k).wait(Duration::from_secs(20)).acquire().await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    ensure!(!waiter.is_finished(), "the waiter got a held lock");
    g.release().await?;
    let g2 = waiter.await.map_err(|e| Fail(e.to_string()))??;
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

pub(super) async fn dropped_guard_is_released(cx: &Ctx) -> CaseResult {
    let (a, b) = (cx.locker().await?, cx.locker().await?);
    let key = cx.key("k");
    let g = a.lock(&key).ttl(Duration::from_secs(60)).acquire().await?;
    drop(g);
    // The TTL is 60 s: getting it within 20 s proves the drop released it.
    let g2 = b.lock(&key).wait(Duration::from_secs(20)).acquire().await?;
    g2.release().await?;
    Ok(())
}

pub(super) async fn repeated_request_is_idempotent(cx: &Ctx) -> CaseResult {
    let (a, b) = (cx.locker().await?, cx.locker().await?);
    let key = Key::new(cx.key("k"))?;
    // What a retry after a lost reply sends: the same default-owner request again.
    let req = fencelock_core::backend::Request::new(
        key.clone(),
        Owner::new("retrying-owner")?,
        Mode::Exclusive,
        cx.ttl,
    )
    .with_reentrant(false);
    let first = a
        .backend()
        .try_acquire(&req)
        .await?
        .ok_or_else(|| Fail("free lock refused".into()))?;
    let again = a
        .backend()
        .try_acquire(&req)
        .await?
        .ok_or_else(|| Fail("a repeated request was refused".into()))?;
    ensure!(
        first.token == again.token,
        "a repeated request got a new token: {:?} → {:?}",
        first.token,
        again.token
    );
    ensure!(
        again.holds == 1,
        "a repeated request added a hold ({} holds)",
        again.holds
    );
    let lease = fencelock_core::backend::LeaseRef::new(&req, &first);
    let released = a.backend().release(&lease).await?;
    ensure!(
        released.remaining == 0,
        "one release left {} holds",
        released.remaining
    );
    ensure!(
        b.lock(key.as_str()).try_acquire().await?.is_some(),
        "still held after the one release"
    );
    Ok(())
}

pub(super) async fn non_owner_release_is_not_held(cx: &Ctx) -> CaseResult {
    let (a, b) = (cx.locker().await?, cx.locker().await?);
    let key = cx.key("k");
    let g = a.lock(&key).acquire().await?;
    let mut intruder = g.lease_ref().clone();
    intruder.owner = Owner::new("intruder")?;
    let r = b.backend().release(&intruder).await;
    ensure!(
        matches!(r, Err(Error::NotHeld { .. })),
        "a non-owner release: expected NotHeld, got {r:?}"
    );
    ensure!(
        b.lock(&key).try_acquire().await?.is_none(),
        "a non-owner release freed the lock"
    );
    ensure!(
        g.is_valid(),
        "the holder lost its lock to a non-owner release"
    );
    g.release().await?;
    let r = b.backend().release(&intruder).await;
    ensure!(
        matches!(r, Err(Error::NotHeld { .. })),
        "releasing a free lock: expected NotHeld, got {r:?}"
    );
    Ok(())
}
