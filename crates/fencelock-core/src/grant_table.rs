//! A client's own record of its grants, for backends whose server keeps one
//! node or key per grant (etcd, ZooKeeper): by key and owner, for reentry,
//! and by token, for each lease's renewal and release.

use std::collections::HashMap;

use crate::backend::LeaseRef;
use crate::key::{Key, Owner};

/// A grant as a [`GrantTable`] keeps it: something with the grant's token.
pub trait Tokened {
    /// The grant's fencing token (unique per key).
    fn token(&self) -> u64;
}

/// A client's grants by key, owner and token.
///
/// One owner may hold one key by more than one grant at once — two shared
/// acquires of the same owner racing past the reentry check both get a node
/// — so an owner's key maps to a list, and a lease finds its own grant by
/// token, never another grant of the same owner name (ARCHITECTURE §2).
///
/// # Examples
///
/// ```
/// use fencelock_core::backend::{GrantTable, Tokened};
/// use fencelock_core::{Key, Owner};
///
/// struct Node { path: String, token: u64 }
/// impl Tokened for Node {
///     fn token(&self) -> u64 { self.token }
/// }
///
/// # fn main() -> fencelock_core::Result<()> {
/// let (k, o) = (Key::new("k")?, Owner::new("me")?);
/// let mut table = GrantTable::new();
/// table.insert(&k, &o, Node { path: "/k/1".into(), token: 7 });
/// table.insert(&k, &o, Node { path: "/k/2".into(), token: 8 });
/// assert_eq!(table.first(&k, &o).map(|n| n.token), Some(7)); // reentry joins the first
/// assert_eq!(table.get(&k, &o, 8).map(|n| n.path.as_str()), Some("/k/2"));
/// assert!(table.remove(&k, &o, 7).is_some());
/// assert!(table.get(&k, &o, 7).is_none()); // a stale lease finds nothing
/// assert_eq!(table.len(), 1);
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct GrantTable<H> {
    grants: HashMap<(Key, Owner), Vec<H>>,
}

impl<H> Default for GrantTable<H> {
    fn default() -> Self {
        GrantTable {
            grants: HashMap::new(),
        }
    }
}

impl<H: Tokened> GrantTable<H> {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// The oldest grant `owner` has on `key` (the one a reentrant acquire joins).
    pub fn first(&self, key: &Key, owner: &Owner) -> Option<&H> {
        self.grants.get(&(key.clone(), owner.clone()))?.first()
    }

    /// The grant of `owner` on `key` with `token`.
    pub fn get(&self, key: &Key, owner: &Owner, token: u64) -> Option<&H> {
        self.grants
            .get(&(key.clone(), owner.clone()))?
            .iter()
            .find(|h| h.token() == token)
    }

    /// The grant of `owner` on `key` with `token`, to change.
    pub fn get_mut(&mut self, key: &Key, owner: &Owner, token: u64) -> Option<&mut H> {
        self.grants
            .get_mut(&(key.clone(), owner.clone()))?
            .iter_mut()
            .find(|h| h.token() == token)
    }

    /// The grant `lease` was given (none for a lease without a token).
    pub fn of_lease(&self, lease: &LeaseRef) -> Option<&H> {
        self.get(&lease.key, &lease.owner, lease.token?.get())
    }

    /// The grant `lease` was given, to change.
    pub fn of_lease_mut(&mut self, lease: &LeaseRef) -> Option<&mut H> {
        self.get_mut(&lease.key, &lease.owner, lease.token?.get())
    }

    /// Records a grant (after any others of the same owner and key).
    pub fn insert(&mut self, key: &Key, owner: &Owner, grant: H) {
        self.grants
            .entry((key.clone(), owner.clone()))
            .or_default()
            .push(grant);
    }

    /// Forgets the grant of `owner` on `key` with `token`, returning it.
    pub fn remove(&mut self, key: &Key, owner: &Owner, token: u64) -> Option<H> {
        let id = (key.clone(), owner.clone());
        let list = self.grants.get_mut(&id)?;
        let at = list.iter().position(|h| h.token() == token)?;
        let gone = list.remove(at);
        if list.is_empty() {
            self.grants.remove(&id);
        }
        Some(gone)
    }

    /// Forgets every grant `drop` says to, returning them.
    pub fn remove_where(&mut self, mut drop: impl FnMut(&H) -> bool) -> Vec<H> {
        let mut out = Vec::new();
        self.grants.retain(|_, list| {
            let mut i = 0;
            while i < list.len() {
                if drop(&list[i]) {
                    out.push(list.remove(i));
                } else {
                    i += 1;
                }
            }
            !list.is_empty()
        });
        out
    }

    /// Every grant.
    pub fn values(&self) -> impl Iterator<Item = &H> {
        self.grants.values().flatten()
    }

    /// How many grants there are.
    pub fn len(&self) -> usize {
        self.grants.values().map(Vec::len).sum()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.grants.is_empty()
    }
}
