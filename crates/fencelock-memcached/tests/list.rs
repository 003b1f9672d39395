//! `list` walks memcached's items with the LRU crawler, which serves one
//! walk at a time: a list right after another, or overlapping others (two
//! operators, a `--watch` refresh), must still answer. One test, so that no
//! other list of this binary overlaps the sequential ones.

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
async fn lists_in_a_row_see_the_held_key_and_overlapping_lists_answer() {
    let prefix = unique("held");
    let holder = Locker::new(MemcachedBackend::connect(URL).await.unwrap());
    let held = holder.lock(format!("{prefix}/a")).acquire().await.unwrap();

    let operator = Locker::new(MemcachedBackend::connect(URL).await.unwrap());
    for i in 0..10 {
        let found = operator.list(&prefix).await.unwrap();
        assert_eq!(found.len(), 1, "list {i} right after another: {found:?}");
    }

    // Overlapping walks: memcached answers `BUSY` to all but one. Whether
    // each saw the key is not asserted: a walk can skip an item that another
    // client reads at that instant, and these lists read what they find.
    let mut lists = Vec::new();
    for _ in 0..4 {
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
