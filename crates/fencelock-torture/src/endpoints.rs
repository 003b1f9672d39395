//! The servers a backend URL names, and the same URL through fault proxies.

use std::net::{SocketAddr, ToSocketAddrs};

/// The `host:port` list of a URL's authority and where it sits in the URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoints {
    /// Text before the host list (`scheme://user:pw@`).
    head: String,
    /// The hosts as written.
    hosts: Vec<String>,
    /// Text after the host list (`/db?mode=lease`).
    tail: String,
}

impl Endpoints {
    /// Splits `url`; `None` when it names no network server (`sqlite://`,
    /// `memory://`) or a host has no port.
    pub fn parse(url: &str) -> Option<Endpoints> {
        let (scheme, rest) = url.split_once("://")?;
        if matches!(scheme, "sqlite" | "memory") {
            return None;
        }
        let auth_end = rest.find(['/', '?']).unwrap_or(rest.len());
        let (auth, tail) = rest.split_at(auth_end);
        let (user, hosts) = match auth.rfind('@') {
            Some(i) => (&auth[..=i], &auth[i + 1..]),
            None => ("", auth),
        };
        let hosts: Vec<String> = hosts.split(',').map(str::to_string).collect();
        if hosts.iter().any(|h| h.rsplit_once(':').is_none()) {
            return None;
        }
        Some(Endpoints {
            head: format!("{scheme}://{user}"),
            hosts,
            tail: tail.to_string(),
        })
    }

    /// The hosts' addresses.
    ///
    /// # Errors
    ///
    /// A host that does not resolve.
    pub fn addrs(&self) -> std::io::Result<Vec<SocketAddr>> {
        self.hosts
            .iter()
            .map(|h| {
                h.to_socket_addrs()?.next().ok_or_else(|| {
                    std::io::Error::new(
                        std::io::ErrorKind::NotFound,
                        format!("{h} does not resolve"),
                    )
                })
            })
            .collect()
    }

    /// The URL with host `i` replaced by `via[i]`.
    pub fn through(&self, via: &[SocketAddr]) -> String {
        let hosts: Vec<String> = via.iter().map(SocketAddr::to_string).collect();
        format!("{}{}{}", self.head, hosts.join(","), self.tail)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_are_replaced_and_the_rest_kept() {
        let e = Endpoints::parse("postgres://u:p@w@127.0.0.1:5432/test?mode=lease").unwrap();
        assert_eq!(
            e.addrs().unwrap(),
            ["127.0.0.1:5432".parse::<SocketAddr>().unwrap()]
        );
        let via: SocketAddr = "127.0.0.1:9".parse().unwrap();
        assert_eq!(
            e.through(&[via]),
            "postgres://u:p@w@127.0.0.1:9/test?mode=lease"
        );
        let z = Endpoints::parse("zk://127.0.0.1:1,127.0.0.1:2/chroot").unwrap();
        assert_eq!(z.addrs().unwrap().len(), 2);
        assert_eq!(
            z.through(&[via, via]),
            "zk://127.0.0.1:9,127.0.0.1:9/chroot"
        );
        assert_eq!(Endpoints::parse("sqlite:///tmp/x.db"), None);
        assert_eq!(Endpoints::parse("memory://"), None);
        assert_eq!(Endpoints::parse("redis://localhost"), None, "no port");
    }
}
