//! CAS-checked writes of many items in one round trip: async-memcached
//! pipelines reads (`meta_get_multi`) but gives every write of a pipeline the
//! same flags, and each renewal's write needs its own CAS value and expiry.
//! So the meta `ms` commands of a batch are written at once on a connection
//! of this module, and their replies (one line each, in order) read back.

use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufStream};
use tokio::net::TcpStream;

/// One CAS-checked write: item name, new value, the CAS value it must still
/// have, and the new expiry in seconds.
pub(crate) struct CasWrite {
    pub(crate) name: String,
    pub(crate) value: String,
    pub(crate) cas: u64,
    pub(crate) secs: u64,
}

/// A connection for batched writes.
pub(crate) struct Pipe {
    stream: BufStream<TcpStream>,
}

impl Pipe {
    pub(crate) async fn connect(addr: &str) -> std::io::Result<Pipe> {
        let stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        Ok(Pipe {
            stream: BufStream::new(stream),
        })
    }

    /// Sends every write of `writes` (names must be valid memcached keys)
    /// and returns, for each, whether it was stored (false: the CAS value
    /// changed, or the item is gone).
    ///
    /// # Errors
    ///
    /// I/O errors and a reply that is not one of `HD`, `EX`, `NF`, `NS`; the
    /// connection must then be dropped (as it must if this future is).
    pub(crate) async fn cas_write_all(
        &mut self,
        writes: &[CasWrite],
        limit: Duration,
    ) -> std::io::Result<Vec<bool>> {
        tokio::time::timeout(limit, self.send(writes))
            .await
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "no reply"))?
    }

    async fn send(&mut self, writes: &[CasWrite]) -> std::io::Result<Vec<bool>> {
        for w in writes {
            let head = format!("ms {} {} C{} T{}\r\n", w.name, w.value.len(), w.cas, w.secs);
            self.stream.write_all(head.as_bytes()).await?;
            self.stream.write_all(w.value.as_bytes()).await?;
            self.stream.write_all(b"\r\n").await?;
        }
        self.stream.flush().await?;
        let mut out = Vec::with_capacity(writes.len());
        let mut line = String::new();
        for _ in writes {
            line.clear();
            if self.stream.read_line(&mut line).await? == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            out.push(match line.split_ascii_whitespace().next() {
                Some("HD") => true,
                Some("EX" | "NF" | "NS") => false,
                _ => {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        format!("unexpected reply to ms: {:?}", line.trim_end()),
                    ));
                }
            });
        }
        Ok(out)
    }
}
