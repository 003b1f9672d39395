//! The queue of one lock: its nodes (the keys under `<prefix><key>/`) in
//! create-revision order, what each stands for, and whom a waiter waits for.

use fencelock_core::backend::{QueueRole, QueueWait, queue_blocker};
use fencelock_core::{Mode, Owner};

/// Marks a node value written by fencelock: `fencelock1 <kind> <owner>`.
const TAG: &str = "fencelock1";

/// One node of a lock's queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Node {
    /// The full etcd key.
    pub(crate) key: String,
    /// Its create revision: the queue order and the holder's fencing token.
    pub(crate) rev: i64,
    /// The etcd lease it is attached to.
    pub(crate) lease: i64,
    /// A writer for every node fencelock did not write (`etcdctl lock`, Go's
    /// `concurrency.Mutex`).
    pub(crate) kind: QueueRole,
    /// The permits of a semaphore node (0 otherwise).
    pub(crate) permits: u32,
    /// Who holds it; a foreign node is named by its lease.
    pub(crate) owner: String,
}

impl Node {
    /// The mode this node holds in.
    pub(crate) fn mode(&self) -> Mode {
        match self.kind {
            QueueRole::Reader => Mode::Shared,
            QueueRole::Permit => Mode::Semaphore {
                permits: self.permits,
            },
            _ => Mode::Exclusive,
        }
    }
}

/// The value fencelock writes into its node.
pub(crate) fn value(mode: Mode, owner: &Owner) -> String {
    match mode {
        Mode::Shared => format!("{TAG} shared {owner}"),
        Mode::Semaphore { permits } => format!("{TAG} permits={permits} {owner}"),
        _ => format!("{TAG} exclusive {owner}"),
    }
}

/// Reads one key of the range under `lock_prefix`; `None` for keys deeper down
/// (the nodes of a lock whose name continues with `/`).
pub(crate) fn parse(
    lock_prefix: &str,
    key: &[u8],
    value: &[u8],
    rev: i64,
    lease: i64,
) -> Option<Node> {
    let key = std::str::from_utf8(key).ok()?;
    let leaf = key.strip_prefix(lock_prefix)?;
    if leaf.is_empty() || leaf.contains('/') {
        return None;
    }
    let foreign = || (QueueRole::Writer, 0, format!("etcd lease {lease:x}"));
    let (kind, permits, owner) = match std::str::from_utf8(value)
        .ok()
        .and_then(|v| v.strip_prefix(TAG)?.strip_prefix(' '))
        .and_then(|v| v.split_once(' '))
    {
        Some(("exclusive", owner)) => (QueueRole::Writer, 0, owner.to_string()),
        Some(("shared", owner)) => (QueueRole::Reader, 0, owner.to_string()),
        Some((p, owner)) => match p.strip_prefix("permits=").and_then(|n| n.parse().ok()) {
            Some(n) => (QueueRole::Permit, n, owner.to_string()),
            None => foreign(),
        },
        None => foreign(),
    };
    Some(Node {
        key: key.to_string(),
        rev,
        lease,
        kind,
        permits,
        owner,
    })
}

/// What the node at `index` waits for before it holds.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Wait<'a> {
    /// The deletion of this node (the nearest one before that blocks it): one
    /// release wakes one waiter.
    Node(&'a Node),
    /// Any deletion before it (a semaphore full of permits).
    Deletes,
}

/// `None` when the node at `index` of `nodes` (sorted by create revision)
/// holds, by the rule of [`queue_blocker`].
pub(crate) fn blocker(nodes: &[Node], index: usize, permits: u32) -> Option<Wait<'_>> {
    let roles: Vec<QueueRole> = nodes.iter().map(|n| n.kind).collect();
    queue_blocker(&roles, index, permits).map(|w| match w {
        QueueWait::Entry(i) => Wait::Node(&nodes[i]),
        _ => Wait::Deletes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queue(spec: &[&str]) -> Vec<Node> {
        spec.iter()
            .enumerate()
            .map(|(i, v)| {
                let rev = i as i64 + 10;
                parse(
                    "p/k/",
                    format!("p/k/{rev:x}").as_bytes(),
                    v.as_bytes(),
                    rev,
                    7,
                )
                .unwrap()
            })
            .collect()
    }

    #[test]
    fn values_round_trip_and_foreign_nodes_are_writers() {
        let o = Owner::new("me 1").unwrap();
        for mode in [
            Mode::Exclusive,
            Mode::Shared,
            Mode::Semaphore { permits: 3 },
        ] {
            let n = parse("p/k/", b"p/k/1", value(mode, &o).as_bytes(), 5, 1).unwrap();
            assert_eq!((n.mode(), n.owner.as_str()), (mode, "me 1"));
        }
        let n = parse("p/k/", b"p/k/694d7a", b"", 5, 0x694d7a).unwrap();
        assert_eq!(n.kind, QueueRole::Writer);
        assert_eq!(n.owner, "etcd lease 694d7a");
        assert!(parse("p/k/", b"p/k/x/694d7a", b"", 5, 1).is_none());
        assert!(parse("p/k/", b"p/kk/1", b"", 5, 1).is_none());
    }

    #[test]
    fn writers_wait_for_their_predecessor_readers_for_the_last_writer() {
        let w = value(Mode::Exclusive, &Owner::new("w").unwrap());
        let r = value(Mode::Shared, &Owner::new("r").unwrap());
        let q = queue(&[&r, &r, &w, &r, "", &r]);
        assert_eq!(blocker(&q, 0, 0), None);
        assert_eq!(blocker(&q, 1, 0), None);
        assert_eq!(blocker(&q, 2, 0), Some(Wait::Node(&q[1])));
        assert_eq!(blocker(&q, 3, 0), Some(Wait::Node(&q[2])));
        // A foreign node (etcdctl lock) is a writer.
        assert_eq!(blocker(&q, 5, 0), Some(Wait::Node(&q[4])));
    }

    #[test]
    fn permits_admit_n_and_wait_for_any_release() {
        let p = value(Mode::Semaphore { permits: 2 }, &Owner::new("p").unwrap());
        let w = value(Mode::Exclusive, &Owner::new("w").unwrap());
        let q = queue(&[&p, &p, &p, &w, &p]);
        assert_eq!(blocker(&q, 1, 2), None);
        assert_eq!(blocker(&q, 2, 2), Some(Wait::Deletes));
        assert_eq!(blocker(&q, 4, 2), Some(Wait::Node(&q[3])));
    }
}
