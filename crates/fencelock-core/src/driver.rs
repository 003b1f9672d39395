//! [`Driver`]: how a URL opens a backend, one per backend crate.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::memory::MemoryBackend;

/// The future of [`Driver::connect`].
pub type Connecting<'a> = Pin<Box<dyn Future<Output = Result<Arc<dyn Backend>>> + Send + 'a>>;

/// How the `fencelock` facade opens a backend from a URL: every backend
/// crate exports one (`fencelock_sqlite::DRIVER`, …), and the facade's
/// `connect` picks the driver whose [`schemes`](Driver::schemes) has the
/// URL's scheme.
///
/// # Examples
///
/// ```
/// use fencelock_core::backend::MEMORY_DRIVER;
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> fencelock_core::Result<()> {
/// assert!(MEMORY_DRIVER.schemes.contains(&"memory"));
/// let backend = (MEMORY_DRIVER.connect)("memory://tests").await?;
/// assert_eq!(backend.name(), "memory");
/// # Ok(()) }
/// ```
#[derive(Clone, Copy)]
pub struct Driver {
    /// The backend's name (`compiled_backends` lists it).
    pub name: &'static str,
    /// The URL schemes it opens, in lower case.
    pub schemes: &'static [&'static str],
    /// Opens the backend a URL of one of [`schemes`](Driver::schemes) names.
    pub connect: fn(&str) -> Connecting<'_>,
}

impl std::fmt::Debug for Driver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Driver")
            .field("name", &self.name)
            .field("schemes", &self.schemes)
            .finish_non_exhaustive()
    }
}

/// The driver of the memory backend: `memory://NAME` is the process-wide
/// instance called `NAME` (see [`MemoryBackend::named`]).
pub const MEMORY_DRIVER: Driver = Driver {
    name: "memory",
    schemes: &["memory"],
    connect: connect_memory,
};

fn connect_memory(url: &str) -> Connecting<'_> {
    Box::pin(async move {
        let name = url.split_once("://").map_or("", |(_, rest)| rest);
        if name.contains('?') {
            return Err(Error::config("memory:// takes no options"));
        }
        Ok(Arc::new(MemoryBackend::named(name)) as Arc<dyn Backend>)
    })
}

/// Makes the [`Driver`] of a backend type whose `connect(url: &str)` is an
/// `async fn` returning `Result<Self>`.
///
/// ```ignore
/// pub const DRIVER: fencelock_core::backend::Driver =
///     fencelock_core::driver!("sqlite", ["sqlite"], SqliteBackend::connect);
/// ```
#[macro_export]
macro_rules! driver {
    ($name:expr, [$($scheme:literal),+ $(,)?], $connect:path) => {
        $crate::backend::Driver {
            name: $name,
            schemes: &[$($scheme),+],
            connect: {
                fn connect(url: &str) -> $crate::backend::Connecting<'_> {
                    ::std::boxed::Box::pin(async move {
                        let backend = $connect(url).await?;
                        Ok(::std::sync::Arc::new(backend) as ::std::sync::Arc<dyn $crate::backend::Backend>)
                    })
                }
                connect
            },
        }
    };
}
