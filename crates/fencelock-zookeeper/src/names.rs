//! Paths and node names: keys as path segments, and the node names of
//! Curator's recipes (protected mode: `_c_<uuid>-<kind><sequence>`).

use fencelock_core::Mode;
use fencelock_core::backend::{QueueRole, QueueWait, queue_blocker};

use crate::options::Writer;

/// What a lock node stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// `InterProcessMutex`: `lock-`.
    Mutex,
    /// `InterProcessReadWriteLock`'s write lock: `__WRIT__`.
    Write,
    /// A read lock: `__READ__lock-` beside `InterProcessMutex`es,
    /// `__READ__` (`InterProcessReadWriteLock`'s read lock) beside its writers.
    Read,
    /// fencelock's semaphore permit: `__SEMA__lock-` beside
    /// `InterProcessMutex`es, `__SEMA____WRIT__` beside read-write locks.
    Permit,
}

/// Every name fragment a lock node may end in (before its sequence), most
/// specific first, with its kind. The `__READ__` and `__SEMA__` fragments
/// without a suffix are the names of earlier fencelock versions.
const FRAGMENTS: [(&str, Kind); 7] = [
    ("__READ__lock-", Kind::Read),
    ("__SEMA__lock-", Kind::Permit),
    ("__SEMA____WRIT__", Kind::Permit),
    ("lock-", Kind::Mutex),
    ("__WRIT__", Kind::Write),
    ("__READ__", Kind::Read),
    ("__SEMA__", Kind::Permit),
];

impl Kind {
    /// The name fragment of a new node of this kind among the exclusive
    /// nodes `writer` makes. Curator sorts a lock's children by what follows
    /// the last occurrence of its own fragment (`lock-` for a mutex; `__READ__`
    /// then `__WRIT__` for a read-write lock), so a node it must wait for ends
    /// in that fragment: else it sorts after every node of its own and is
    /// ignored.
    pub(crate) fn fragment(self, writer: Writer) -> &'static str {
        match (self, writer) {
            (Kind::Mutex, _) => "lock-",
            (Kind::Write, _) => "__WRIT__",
            (Kind::Read, Writer::ReadWriteLock) => "__READ__",
            (Kind::Read, _) => "__READ__lock-",
            (Kind::Permit, Writer::ReadWriteLock) => "__SEMA____WRIT__",
            (Kind::Permit, _) => "__SEMA__lock-",
        }
    }

    pub(crate) fn mode(self, permits: u32) -> Mode {
        match self {
            Kind::Mutex | Kind::Write => Mode::Exclusive,
            Kind::Read => Mode::Shared,
            Kind::Permit => Mode::Semaphore { permits },
        }
    }
}

/// One child of a lock path that is a lock node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LockNode {
    pub(crate) name: String,
    pub(crate) kind: Kind,
    pub(crate) sequence: u64,
}

/// Parses a child name; `None` for nodes that are not lock nodes.
pub(crate) fn parse_node(name: &str) -> Option<LockNode> {
    // The sequence is the trailing digits (10, or 19 past i32::MAX).
    let digits = name.bytes().rev().take_while(u8::is_ascii_digit).count();
    if digits < 10 {
        return None;
    }
    let (stem, seq) = name.split_at(name.len() - digits);
    let kind = FRAGMENTS
        .iter()
        .find(|(f, _)| stem.ends_with(f))
        .map(|&(_, k)| k)?;
    Some(LockNode {
        name: name.to_string(),
        kind,
        sequence: seq.parse().ok()?,
    })
}

/// The lock nodes among `children`, in sequence order.
pub(crate) fn sorted_nodes(children: &[String]) -> Vec<LockNode> {
    let mut nodes: Vec<LockNode> = children.iter().filter_map(|c| parse_node(c)).collect();
    nodes.sort_by_key(|n| n.sequence);
    nodes
}

/// Escapes a key into one path segment: `%` → `%25`, `/` → `%2F`, the
/// characters ZooKeeper refuses in a path (outside the Basic Multilingual
/// Plane, private use, U+FFF0 and above) as `%XX` per UTF-8 byte, and the
/// names it refuses (`.`, `..`) get their dots escaped.
pub(crate) fn escape_key(key: &str) -> String {
    let mut out = String::with_capacity(key.len());
    for c in key.chars() {
        match c {
            '%' => out.push_str("%25"),
            '/' => out.push_str("%2F"),
            '\u{e000}'..='\u{f8ff}' | '\u{fff0}'.. => {
                let mut buf = [0; 4];
                for b in c.encode_utf8(&mut buf).bytes() {
                    out.push_str(&format!("%{b:02X}"));
                }
            }
            _ => out.push(c),
        }
    }
    if out == "." || out == ".." {
        out = out.replace('.', "%2E");
    }
    out
}

/// Reverses [`escape_key`].
pub(crate) fn unescape_key(segment: &str) -> String {
    let mut out = Vec::with_capacity(segment.len());
    let bytes = segment.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let code = segment
            .get(i + 1..i + 3)
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], code) {
            (b'%', Some(b)) => {
                out.push(b);
                i += 3;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// What a waiting node watches.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Wait<'a> {
    /// The one node whose deletion can let it in (herd-free).
    Node(&'a LockNode),
    /// Any change of the lock's children (permits: any of several holders ahead
    /// may go first).
    Children,
}

/// What the node at `index` of `nodes` waits for: `None` when it holds, by the
/// rule of [`queue_blocker`] (mutex and write nodes are writers); blocked by
/// the count, a permit watches the children.
pub(crate) fn blocker(nodes: &[LockNode], index: usize, permits: u32) -> Option<Wait<'_>> {
    let roles: Vec<QueueRole> = nodes
        .iter()
        .map(|n| match n.kind {
            Kind::Mutex | Kind::Write => QueueRole::Writer,
            Kind::Read => QueueRole::Reader,
            Kind::Permit => QueueRole::Permit,
        })
        .collect();
    queue_blocker(&roles, index, permits).map(|w| match w {
        QueueWait::Entry(i) => Wait::Node(&nodes[i]),
        _ => Wait::Children,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nodes(spec: &[&str]) -> Vec<LockNode> {
        let names: Vec<String> = spec
            .iter()
            .enumerate()
            .map(|(i, k)| format!("_c_x-{k}{:010}", i + 1))
            .collect();
        sorted_nodes(&names)
    }

    #[test]
    fn parses_curator_names() {
        let n = parse_node("_c_4c7a3b0e-1111-2222-3333-444455556666-lock-0000000042").unwrap();
        assert_eq!((n.kind, n.sequence), (Kind::Mutex, 42));
        assert_eq!(
            parse_node("_c_u-__READ__0000000007").unwrap().kind,
            Kind::Read
        );
        assert_eq!(
            parse_node("_c_u-__WRIT__0000000007").unwrap().kind,
            Kind::Write
        );
        assert_eq!(parse_node("leases"), None);
        assert_eq!(parse_node("lock-12"), None);
    }

    /// What Curator's (and kazurator's) sort key makes of a child name: what
    /// follows the last occurrence of the lock name, or the whole name.
    fn curator_sort_key<'a>(name: &'a str, lock_name: &str) -> &'a str {
        name.rfind(lock_name)
            .map_or(name, |i| &name[i + lock_name.len()..])
    }

    #[test]
    fn every_node_a_curator_peer_must_wait_for_sorts_by_its_sequence() {
        for writer in [Writer::Mutex, Writer::ReadWriteLock] {
            for kind in [Kind::Mutex, Kind::Write, Kind::Read, Kind::Permit] {
                let name = format!("_c_u-{}0000000007", kind.fragment(writer));
                let parsed = parse_node(&name).unwrap();
                assert_eq!((parsed.kind, parsed.sequence), (kind, 7), "{name}");
            }
            let exclusive = match writer {
                Writer::Mutex => Kind::Mutex,
                _ => Kind::Write,
            };
            let ours = [exclusive, Kind::Read, Kind::Permit]
                .map(|k| format!("_c_u-{}0000000007", k.fragment(writer)));
            for name in ours {
                let key = match writer {
                    // InterProcessMutex: by what follows `lock-`.
                    Writer::Mutex => curator_sort_key(&name, "lock-"),
                    // InterProcessReadWriteLock: `__READ__`, then `__WRIT__`.
                    _ => curator_sort_key(curator_sort_key(&name, "__READ__"), "__WRIT__"),
                };
                assert_eq!(key, "0000000007", "{name} under {writer:?}");
            }
        }
        // A permit beside read-write locks is a writer to Curator's readers.
        assert!(
            Kind::Permit
                .fragment(Writer::ReadWriteLock)
                .contains("__WRIT__")
        );
    }

    #[test]
    fn who_waits_for_whom() {
        let seq = |w: Option<Wait<'_>>| match w {
            Some(Wait::Node(n)) => Some(n.sequence),
            _ => None,
        };
        let n = nodes(&["lock-", "lock-", "lock-"]);
        assert_eq!(blocker(&n, 0, 0), None);
        assert_eq!(seq(blocker(&n, 2, 0)), Some(2));
        let n = nodes(&["__READ__", "__READ__", "__WRIT__", "__READ__", "__READ__"]);
        assert_eq!(blocker(&n, 1, 0), None, "readers share");
        assert_eq!(
            seq(blocker(&n, 2, 0)),
            Some(2),
            "a writer waits for the reader just before it"
        );
        assert_eq!(
            seq(blocker(&n, 4, 0)),
            Some(3),
            "a reader waits for the last writer before it"
        );
        let n = nodes(&["__SEMA__", "__SEMA__", "__SEMA__"]);
        assert_eq!(blocker(&n, 1, 2), None);
        assert_eq!(blocker(&n, 2, 2), Some(Wait::Children));
        let n = nodes(&["lock-", "__READ__"]);
        assert_eq!(seq(blocker(&n, 1, 0)), Some(1), "a mutex excludes readers");
    }

    #[test]
    fn keys_escape_to_one_segment() {
        for k in [
            "orders/42",
            "100%",
            ".",
            "..",
            "a.b",
            "x%2Fy",
            "report-🔒",
            "\u{e000}\u{fff0}é",
        ] {
            let e = escape_key(k);
            assert!(!e.contains('/') && e != "." && e != "..", "{k} → {e}");
            assert_eq!(unescape_key(&e), k);
        }
    }
}
