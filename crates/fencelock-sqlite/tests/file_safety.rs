//! What an operator may do to the lock file, and what no holder may suffer
//! from it: a file deleted or replaced under holders (they learn it at their
//! next renewal, and no token of the old file is handed out again), an older
//! copy restored (tokens do not go back), a second name for the file (refused:
//! it would have a WAL of its own). Steps of the wall clock are in
//! `clock_steps.rs` (the clock hook is process-wide).

use std::path::Path;
use std::time::Duration;

use fencelock_core::{Locker, LostReason};
use fencelock_sqlite::SqliteBackend;

async fn locker(path: &Path) -> Locker {
    Locker::new(SqliteBackend::open(path).await.unwrap())
}

/// Waits until the last connection to `path` has closed: a dropped locker's
/// connection closes when its watchdog task ends, a moment later, and SQLite
/// deletes the `-wal` at that close (by name: deleting or copying the file
/// meanwhile is what the docs forbid while a process uses it).
async fn closed(path: &Path) {
    let mut wal = path.as_os_str().to_owned();
    wal.push("-wal");
    let wal = std::path::PathBuf::from(wal);
    let waited = tokio::time::timeout(Duration::from_secs(30), async {
        while wal.exists() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert!(
        waited.is_ok(),
        "{} stayed open 30 s after its locker was dropped",
        path.display()
    );
}

fn remove_db(path: &Path) {
    for suffix in ["", "-wal", "-shm"] {
        let mut p = path.as_os_str().to_owned();
        p.push(suffix);
        let _ = std::fs::remove_file(&p);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_deleted_under_a_holder_never_reissues_its_token_and_the_holder_learns_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("locks.db");
    let a = locker(&path).await;
    let ga = a
        .lock("k")
        .ttl(Duration::from_secs(6))
        .acquire()
        .await
        .unwrap();
    let ta = ga.token().unwrap();
    remove_db(&path);
    // A newcomer makes a new file and takes the lock there.
    let b = locker(&path).await;
    let gb = b
        .lock("k")
        .try_acquire()
        .await
        .unwrap()
        .expect("a new file");
    assert!(
        gb.token().unwrap() > ta,
        "the new file handed out token {:?} again after {ta:?}",
        gb.token()
    );
    // A learns it from its next renewal (every 2 s), long before its deadline.
    let lost = tokio::time::timeout(Duration::from_secs(5), ga.lost()).await;
    assert!(
        lost.is_ok(),
        "A renewed a deleted file for 5 s while B held the lock"
    );
    assert!(
        matches!(ga.lease().lost_reason(), Some(LostReason::NotHeld(_))),
        "{:?}",
        ga.lease().lost_reason()
    );
    gb.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_older_copy_restored_never_makes_tokens_go_back() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("locks.db");
    let old = dir.path().join("old.db");
    {
        let a = locker(&path).await;
        for _ in 0..3 {
            a.lock("k")
                .acquire()
                .await
                .unwrap()
                .release()
                .await
                .unwrap();
        }
    }
    // The last connection closed: the file is whole without its WAL.
    closed(&path).await;
    std::fs::copy(&path, &old).unwrap();
    let mut highest = 0;
    {
        let a = locker(&path).await;
        for _ in 0..3 {
            let g = a.lock("k").acquire().await.unwrap();
            highest = g.token().unwrap().get();
            g.release().await.unwrap();
        }
    }
    // Once nobody uses it, an operator restores the older copy in place.
    closed(&path).await;
    remove_db(&path);
    std::fs::copy(&old, &path).unwrap();
    let a = locker(&path).await;
    let g = a.lock("k").acquire().await.unwrap();
    assert!(
        g.token().unwrap().get() > highest,
        "token {:?} after {highest} had been handed out",
        g.token()
    );
    g.release().await.unwrap();
}

/// Opens `path` and expects a refusal that names the links.
async fn refused(path: &Path) {
    match SqliteBackend::open(path).await {
        Err(e) => assert!(e.to_string().contains("link"), "{e}"),
        Ok(b) => {
            let got = Locker::new(b).lock("k").try_acquire().await.unwrap();
            panic!(
                "a lock file with two names was opened (the lock granted there: {})",
                got.is_some()
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_name_for_the_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("locks.db");
    let link = dir.path().join("other-name.db");
    // A link made while nobody has the file open: neither name may be used.
    drop(SqliteBackend::open(&path).await.unwrap());
    std::fs::hard_link(&path, &link).unwrap();
    refused(&path).await;
    refused(&link).await;
    std::fs::remove_file(&link).unwrap();
    // A link made under a holder: the other name is refused, and the holder
    // learns it at its next renewal.
    let a = locker(&path).await;
    let ga = a
        .lock("k")
        .ttl(Duration::from_secs(6))
        .acquire()
        .await
        .unwrap();
    std::fs::hard_link(&path, &link).unwrap();
    refused(&link).await;
    let lost = tokio::time::timeout(Duration::from_secs(5), ga.lost()).await;
    assert!(lost.is_ok(), "A kept renewing a file with two names");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_a_symlink_the_real_files_are_the_ones_watched() {
    let dir = tempfile::tempdir().unwrap();
    let real = dir.path().join("real.db");
    let link = dir.path().join("link.db");
    std::os::unix::fs::symlink(&real, &link).unwrap();
    let a = locker(&link).await;
    let ga = a
        .lock("k")
        .ttl(Duration::from_secs(6))
        .acquire()
        .await
        .unwrap();
    // SQLite keeps the WAL and shared memory beside the target: deleting
    // those (not the link's names, which do not exist) breaks exclusion.
    for suffix in ["-wal", "-shm"] {
        let mut p = real.as_os_str().to_owned();
        p.push(suffix);
        std::fs::remove_file(&p).unwrap();
    }
    let lost = tokio::time::timeout(Duration::from_secs(5), ga.lost()).await;
    assert!(
        lost.is_ok(),
        "A renewed for 5 s after the real -wal and -shm were deleted"
    );
}

/// The lock file's directory removed under a locker: the file cannot be
/// opened again, and waiting cannot mend that, so an acquire without a
/// deadline returns the error instead of asking for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_file_that_cannot_be_opened_again_ends_a_wait_without_a_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let sub = dir.path().join("sub");
    std::fs::create_dir(&sub).unwrap();
    let path = sub.join("locks.db");
    let a = locker(&path).await;
    a.lock("k")
        .acquire()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    std::fs::remove_dir_all(&sub).unwrap();
    let got = tokio::time::timeout(
        Duration::from_secs(30),
        a.lock("k").wait_forever().acquire(),
    )
    .await
    .expect("the acquire still asked after 30 s");
    let e = got.expect_err("granted in a file that cannot exist");
    assert!(!e.is_transient(), "{e:?}");
    assert!(e.to_string().contains("locks.db"), "{e}");
}
