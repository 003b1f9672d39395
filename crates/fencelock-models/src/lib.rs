//! Models of the protocols fencelock invented, for the `stateright` model
//! checker. Each model abstracts named code (see its module docs), keeps the
//! buggy variant a review found behind a flag, and is checked by the tests of
//! this crate: `cargo test -p fencelock-models --release`. What they cover and
//! what they leave out: `docs/SAFETY.md`.
//!
//! This crate is not in the library's dependency tree.

pub mod redis_queue;
pub mod redlock_token;
