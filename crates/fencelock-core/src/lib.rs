//! The core of fencelock: the lock API, the backend trait, the watchdog, the
//! in-memory backend and the history checker.
//!
//! Most users depend on the `fencelock` facade crate, which re-exports all of
//! this and adds `fencelock::connect(url)` for every backend compiled in. Backend
//! crates depend on this crate only: what they need beyond the user's API
//! (the [`Backend`] trait's types, the URL parser, the wait loop, session
//! bookkeeping, the driver) is in [`backend`].
//!
//! # The contract
//!
//! - [`Key`]s are validated before any I/O; an [`Owner`] acquiring the same key
//!   again in the same [`Mode`] is reentrant.
//! - Every hold has a TTL; the [`Locker`]'s watchdog renews live guards at ttl/3
//!   with one batched call per tick. A [`Guard`] knows a conservative local
//!   deadline and fires [`Guard::lost`] when renewal fails or the deadline passes.
//! - Grants carry a [`FencingToken`] that strictly increases per key, where the
//!   backend's [`Capabilities::fencing`] says so.
//! - Only the owner's release counts: anything else is [`Error::NotHeld`].
//!
//! # Example
//!
//! ```
//! use std::time::Duration;
//! use fencelock_core::{Locker, MemoryBackend};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> fencelock_core::Result<()> {
//! let locker = Locker::new(MemoryBackend::new());
//! let guard = locker.lock("orders/42").ttl(Duration::from_secs(30)).wait(Duration::from_secs(5)).acquire().await?;
//! println!("fenced write with token {:?}", guard.token());
//! guard.release().await?;
//! # Ok(()) }
//! ```
#![warn(missing_docs)]

mod admission;
pub mod backend;
mod background;
mod backoff;
mod capabilities;
pub mod clock;
mod driver;
mod error;
mod grant_slots;
mod grant_table;
mod guard;
mod history;
mod key;
mod line;
mod locker;
mod memory;
mod mode;
mod multi;
mod queue_rule;
mod session_holds;
#[cfg(all(test, shuttle))]
mod shuttle_tests;
mod sync;
pub mod telemetry;
mod token;
mod url;
mod wait;
mod watchdog;

pub use backend::{Backend, HolderInfo, LockInfo};
pub use background::settle;
pub use capabilities::Capabilities;
pub use error::{Cause, Error, Result};
pub use guard::{Guard, Lease, LostReason};
pub use history::{HistorySummary, Hold, Violation, check_history};
pub use key::{Key, MAX_KEY_BYTES, Owner};
pub use locker::{DEFAULT_TTL, LockBuilder, Locker, MIN_TTL};
pub use memory::MemoryBackend;
pub use mode::Mode;
pub use multi::{MultiGuard, MultiLockBuilder};
pub use token::FencingToken;
