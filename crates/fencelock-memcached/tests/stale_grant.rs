//! The grant id (ARCHITECTURE §2): "a renewal or release acts only
//! on the grant its lease was given ... never on a later hold of the same owner
//! name". Attacks on the memcached backend against the shared test server.

use std::time::{Duration, Instant};

use fencelock_core::{Error, Key, Locker};
use fencelock_memcached::MemcachedBackend;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufStream};
use tokio::net::TcpStream;

const URL: &str = "memcached://127.0.0.1:11211";
const ADDR: &str = "127.0.0.1:11211";

fn unique(tag: &str) -> String {
    let n = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("review-{tag}-{n}")
}

/// One text-protocol command, its reply lines up to (and including) one that
/// `done` accepts.
async fn raw(cmd: &[u8], done: impl Fn(&str) -> bool) -> Vec<String> {
    let mut s = BufStream::new(TcpStream::connect(ADDR).await.unwrap());
    s.write_all(cmd).await.unwrap();
    s.flush().await.unwrap();
    let mut out = Vec::new();
    loop {
        let mut line = String::new();
        if s.read_line(&mut line).await.unwrap() == 0 {
            break;
        }
        let line = line.trim_end().to_string();
        let end = done(&line);
        out.push(line);
        if end {
            break;
        }
    }
    out
}

/// What a fencelock release before b5fa377 wrote when it took `key` for
/// `owner`: `fencelock1 <holds> <secs>\n<owner>\n<key>` (no grant id), added
/// with expiry `secs`.
async fn add_as_older_version(key: &str, owner: &str, secs: u64) -> bool {
    let value = format!("fencelock1 1 {secs}\n{owner}\n{key}");
    let cmd = format!(
        "add fencelock:{key} 0 {secs} {}\r\n{value}\r\n",
        value.len()
    );
    let reply = raw(cmd.as_bytes(), |_| true).await;
    reply.first().map(String::as_str) == Some("STORED")
}

async fn item(key: &str) -> Option<String> {
    let cmd = format!("get fencelock:{key}\r\n");
    let lines = raw(cmd.as_bytes(), |l| l == "END").await;
    (lines.len() > 1).then(|| lines[1..lines.len() - 1].join("\n"))
}

/// A guard of this version is broken by an operator; the same owner — a
/// process still running the version before the grant id (a rolling upgrade)
/// — takes the key again. The old guard must find its lease lost and its
/// release must be NotHeld, leaving the new hold alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_guard_leaves_a_retake_by_an_older_version_alone() {
    let a = Locker::new(MemcachedBackend::connect(URL).await.unwrap());
    let key = unique("legacy");
    let owner = "host-1";
    let ttl = Duration::from_secs(3);
    let old = a.lock(&key).owner(owner).ttl(ttl).acquire().await.unwrap();
    MemcachedBackend::connect(URL)
        .await
        .unwrap()
        .force_release(&Key::new(&key).unwrap())
        .await
        .unwrap();
    assert!(
        add_as_older_version(&key, owner, 3).await,
        "retake by the older version"
    );
    let started = Instant::now();
    // Two TTLs: an unrenewed lease is past its deadline long before.
    let lost = tokio::time::timeout(2 * ttl, old.lost()).await;
    let after = item(&key).await;
    println!(
        "after {:?}: old guard lost: {}, valid: {}, item now: {after:?}",
        started.elapsed(),
        lost.is_ok(),
        old.is_valid()
    );
    let r = old.release().await;
    let left = item(&key).await;
    println!("old guard's release: {r:?}; item after it: {left:?}");
    assert!(
        lost.is_ok(),
        "the broken guard stayed valid {:?} after the same owner (older version) retook the key: its renewals extended the new hold",
        2 * ttl
    );
    assert!(
        matches!(r, Err(Error::NotHeld { .. })),
        "the broken guard's release: expected NotHeld, got {r:?}"
    );
    assert!(
        left.is_some(),
        "the broken guard's release freed the same owner's new hold"
    );
}

/// Reentrant holds of one grant renewed in one batch (the same item twice in
/// one pipelined read and one pipeline of CAS writes): both must stay held,
/// and a third, stale lease of an earlier grant of the same owner in the same
/// batch must be lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_batch_with_two_leases_of_one_item_and_a_stale_one() {
    use fencelock_core::Backend;
    use fencelock_core::backend::{LeaseRef, Renewal, Request};
    use fencelock_core::{Mode, Owner};
    let b = MemcachedBackend::connect(URL).await.unwrap();
    let key = Key::new(unique("batch")).unwrap();
    let req = Request::new(
        key.clone(),
        Owner::new("host-2").unwrap(),
        Mode::Exclusive,
        Duration::from_secs(4),
    );
    let first = b.try_acquire(&req).await.unwrap().unwrap();
    let stale = LeaseRef::new(&req, &first);
    b.force_release(&key).await.unwrap();
    let outer = b.try_acquire(&req).await.unwrap().unwrap();
    let nested = b.try_acquire(&req).await.unwrap().unwrap();
    assert_eq!(nested.holds, 2);
    let (lo, ln) = (LeaseRef::new(&req, &outer), LeaseRef::new(&req, &nested));
    let r = b
        .renew(&[lo.clone(), stale.clone(), ln.clone()])
        .await
        .unwrap();
    println!("{r:?}");
    assert!(matches!(r[0], Renewal::Held { .. }), "{r:?}");
    assert!(matches!(r[1], Renewal::Lost { .. }), "{r:?}");
    assert!(matches!(r[2], Renewal::Held { .. }), "{r:?}");
    assert!(matches!(
        b.release(&stale).await,
        Err(Error::NotHeld { .. })
    ));
    assert_eq!(b.release(&ln).await.unwrap().remaining, 1);
    assert_eq!(b.release(&lo).await.unwrap().remaining, 0);
}
