//! `fencelock torture`: a Jepsen-style fault campaign against a backend.
//!
//! Client processes (the binary re-executing itself) loop on three keys —
//! exclusive, read/write, a 2-permit semaphore — and write to a linearizable
//! register under every exclusive hold, with the hold's fencing token. The
//! controller puts a [`fencelock_testkit::FaultProxy`] between every client
//! and every server and injects faults chosen from a seed: paused and killed
//! clients, partitions, lost replies, latency, client clock offsets, and —
//! on servers it started itself — restarts, killed leaders, minorities and
//! majorities. Afterwards the whole history is checked ([`check`]): holds that
//! overlapped, tokens that did not rise, superseded writes the register
//! accepted, semaphores over their permits, guards lost on arrival, and how
//! long the lock was unavailable.
//!
//! See ARCHITECTURE.md §8 for the definitions and FAULTS.md for measured results.
#![warn(missing_docs)]

mod campaign;
pub mod check;
mod client;
mod endpoints;
pub mod events;
mod faults;
pub mod register;
mod servers;

pub use campaign::{Config, Report, run};
pub use client::{ClientConfig, PERMITS, client, keys};
pub use endpoints::Endpoints;
pub use faults::FaultKind;
pub use servers::{Servers, SpawnKind};
