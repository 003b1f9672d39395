//! `list` walks memcached's items with the LRU crawler, which serves one
//! walk at a time: a list right after another, or overlapping it (two
//! operators, a `--watch` refresh), must still answer.

use fencelock_core::Locker;
use fencelock_memcached::MemcachedBackend;

const URL: &str = "memcached://127.0.0.1:11211";

fn unique(tag: &str) -> String {
    let n = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("list-{tag}-{}-{n}", std::process::id())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_list_right_after_another_sees_the_held_key() {
    let prefix = unique("sequential");
    let holder = Locker::new(MemcachedBackend::connect(URL).await.unwrap());
    let held = holder.lock(format!("{prefix}/a")).acquire().await.unwrap();
    let operator = Locker::new(MemcachedBackend::connect(URL).await.unwrap());
    for i in 0..20 {
        let found = operator.list(&prefix).await.unwrap();
        assert_eq!(found.len(), 1, "list {i} right after another: {found:?}");
    }
    held.release().await.unwrap();
}

/// Overlapping walks: memcached answers `BUSY` to all but one. Each list
/// answers (the crawler skips an item that another client reads at that
/// instant, so whether each saw the key is not asserted here; the lists
/// read the key they found, which is such a read).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_lists_all_answer() {
    let prefix = unique("overlapping");
    let holder = Locker::new(MemcachedBackend::connect(URL).await.unwrap());
    let held = holder.lock(format!("{prefix}/a")).acquire().await.unwrap();
    let mut lists = Vec::new();
    for _ in 0..8 {
        let prefix = prefix.clone();
        lists.push(tokio::spawn(async move {
            let locker = Locker::new(MemcachedBackend::connect(URL).await?);
            for _ in 0..5 {
                locker.list(&prefix).await?;
            }
            Ok::<_, fencelock_core::Error>(())
        }));
    }
    for l in lists {
        if let Err(e) = l.await.unwrap() {
            panic!("a list overlapping others failed: {e}");
        }
    }
    held.release().await.unwrap();
}
