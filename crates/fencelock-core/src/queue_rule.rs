//! The ordering rule of queue-based backends (ZooKeeper's sequential nodes,
//! etcd's create revisions): which entries of a lock's queue hold, and whom a
//! waiting entry waits for, so that one release wakes one waiter.
//!
//! # Examples
//!
//! ```
//! use fencelock_core::backend::{QueueRole, QueueWait, queue_blocker};
//!
//! // Two readers, then a writer, then a reader: the readers ahead hold; the
//! // writer waits for the reader just before it; the last reader for the writer.
//! let q = [QueueRole::Reader, QueueRole::Reader, QueueRole::Writer, QueueRole::Reader];
//! assert_eq!(queue_blocker(&q, 1, 0), None);
//! assert_eq!(queue_blocker(&q, 2, 0), Some(QueueWait::Entry(1)));
//! assert_eq!(queue_blocker(&q, 3, 0), Some(QueueWait::Entry(2)));
//! ```

/// The role of one entry of a lock's queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum QueueRole {
    /// An exclusive holder or waiter.
    Writer,
    /// A shared holder or waiter.
    Reader,
    /// A semaphore permit.
    Permit,
}

/// Whom a waiting entry waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum QueueWait {
    /// The release of the entry at this index: the nearest one before it that
    /// blocks it (herd-free).
    Entry(usize),
    /// Any release before it (a permit blocked by the count: any of the holders
    /// ahead may go first).
    AnyRelease,
}

/// What the entry at `index` of `roles` (oldest first) waits for; `None` when
/// it holds:
///
/// - a writer holds when it is first, else it waits for the entry just before it;
/// - a reader holds when no writer or permit is before it, else it waits for the
///   last of those;
/// - a permit of `permits` holds when only permits are before it, fewer than
///   `permits`; blocked by another role it waits for the last such entry,
///   blocked by the count for any release.
///
/// # Panics
///
/// If `index` is out of bounds.
pub fn queue_blocker(roles: &[QueueRole], index: usize, permits: u32) -> Option<QueueWait> {
    let before = &roles[..index];
    let last_other = |me: QueueRole| before.iter().rposition(|r| *r != me);
    match roles[index] {
        QueueRole::Writer => index.checked_sub(1).map(QueueWait::Entry),
        QueueRole::Reader => last_other(QueueRole::Reader).map(QueueWait::Entry),
        QueueRole::Permit => match last_other(QueueRole::Permit) {
            Some(i) => Some(QueueWait::Entry(i)),
            None if before.len() < permits as usize => None,
            None => Some(QueueWait::AnyRelease),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use QueueRole::{Permit, Reader, Writer};

    #[test]
    fn permits_admit_n_and_wait_behind_other_roles() {
        let q = [Permit, Permit, Permit, Writer, Permit];
        assert_eq!(queue_blocker(&q, 1, 2), None);
        assert_eq!(queue_blocker(&q, 2, 2), Some(QueueWait::AnyRelease));
        assert_eq!(queue_blocker(&q, 3, 2), Some(QueueWait::Entry(2)));
        assert_eq!(queue_blocker(&q, 4, 2), Some(QueueWait::Entry(3)));
    }

    #[test]
    fn the_first_writer_holds_and_readers_share_until_a_writer() {
        let q = [Writer, Reader, Reader, Writer];
        assert_eq!(queue_blocker(&q, 0, 0), None);
        assert_eq!(queue_blocker(&q, 1, 0), Some(QueueWait::Entry(0)));
        assert_eq!(queue_blocker(&q, 2, 0), Some(QueueWait::Entry(0)));
        assert_eq!(queue_blocker(&q, 3, 0), Some(QueueWait::Entry(2)));
    }
}
