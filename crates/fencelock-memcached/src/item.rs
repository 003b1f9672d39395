//! How a lock is kept in memcached: the item name of a key, and the value of
//! a held item (`fencelock1 <holds> <expiry secs> <grant>`, the owner and the
//! key, one per line; neither may contain a control character). `<grant>` is
//! a random id made when the item is added: an owner whose hold was broken
//! and who took the key again holds a new grant, which a lease of the old one
//! must not renew or release.

use sha2::{Digest, Sha256};

/// memcached's limit on item names.
const MAX_NAME: usize = 250;

/// The item of `key`: `<prefix><key>` when that is a valid memcached name
/// (printable ASCII without spaces, at most 250 bytes), else
/// `<prefix>sha256:<hex of the key>`.
pub(crate) fn item_name(prefix: &str, key: &str) -> String {
    let plain = format!("{prefix}{key}");
    if plain.len() <= MAX_NAME && plain.bytes().all(|b| b.is_ascii_graphic()) {
        return plain;
    }
    let digest = Sha256::digest(key.as_bytes());
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    format!("{prefix}sha256:{hex}")
}

/// A held item's value.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Holder {
    pub(crate) holds: u32,
    /// The longest expiry (seconds) any of the owner's holds asked for: every
    /// renewal writes at least this, so one hold's short TTL never cuts
    /// another's long one.
    pub(crate) secs: u64,
    pub(crate) owner: String,
    /// The lock's key (the item name may be its hash).
    pub(crate) key: String,
    /// The grant's random id (empty in an item an older version wrote).
    pub(crate) grant: String,
}

impl Holder {
    pub(crate) fn encode(&self) -> String {
        format!(
            "fencelock1 {} {} {}\n{}\n{}",
            self.holds, self.secs, self.grant, self.owner, self.key
        )
    }

    /// `None` for a value fencelock did not write.
    pub(crate) fn decode(data: &[u8]) -> Option<Holder> {
        let text = std::str::from_utf8(data).ok()?;
        let mut lines = text.strip_prefix("fencelock1 ")?.split('\n');
        let (head, owner, key) = (lines.next()?, lines.next()?, lines.next()?);
        let mut head = head.split(' ');
        let holds = head.next()?.parse().ok()?;
        let secs = head.next().unwrap_or("0").parse().ok()?;
        let grant = head.next().unwrap_or("").to_string();
        Some(Holder {
            holds,
            secs,
            owner: owner.to_string(),
            key: key.to_string(),
            grant,
        })
    }

    /// A new grant's random id.
    pub(crate) fn new_grant() -> String {
        uuid::Uuid::new_v4().simple().to_string()
    }

    /// Whether this is the holder a lease of `owner` with grant id `grant`
    /// was given. An item an older version wrote has no id: only a lease
    /// that was handed that item (reentering it) matches it, never one of a
    /// grant made since — that older process may have taken the key again
    /// after this owner's hold was broken.
    pub(crate) fn is_grant(&self, owner: &str, grant: &str) -> bool {
        self.owner == owner && self.grant == grant
    }

    /// The same holder with `holds` holds.
    pub(crate) fn with_holds(&self, holds: u32) -> Holder {
        Holder {
            holds,
            ..self.clone()
        }
    }

    /// The same holder, asking for an expiry of at least `secs`.
    pub(crate) fn at_least(&self, secs: u64) -> Holder {
        Holder {
            secs: self.secs.max(secs),
            ..self.clone()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_valid_memcached_keys() {
        assert_eq!(item_name("fl:", "orders/42"), "fl:orders/42");
        let spaced = item_name("fl:", "with space");
        assert!(spaced.starts_with("fl:sha256:") && spaced.len() == 3 + 7 + 64);
        let long = "x".repeat(256);
        assert!(item_name("fl:", &long).len() <= MAX_NAME);
        assert_ne!(item_name("fl:", "a b"), item_name("fl:", "a c"));
        assert!(item_name("fl:", "ключ").starts_with("fl:sha256:"));
    }

    #[test]
    fn values_round_trip() {
        let h = Holder {
            holds: 3,
            secs: 31,
            owner: "o w n e r".into(),
            key: "k e y".into(),
            grant: Holder::new_grant(),
        };
        assert_eq!(Holder::decode(h.encode().as_bytes()), Some(h.clone()));
        // An older version's item: no grant id.
        let old = Holder::decode(b"fencelock1 3 31\no w n e r\nk e y").unwrap();
        assert_eq!(old.grant, "");
        assert!(old.is_grant(&h.owner, "") && h.is_grant(&h.owner, &h.grant));
        assert!(
            !old.is_grant(&h.owner, &h.grant),
            "an older version's retake matched"
        );
        assert!(!h.is_grant(&h.owner, "another grant") && !h.is_grant("other", &h.grant));
        assert_eq!(Holder::decode(b"something else"), None);
    }
}
