//! The wall clock that backends storing expiry times read, with a hook that
//! lets fault tests shift it (a client whose clock is off).

use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, SystemTime};

static OFFSET_MS: AtomicI64 = AtomicI64::new(0);

/// Now by this process's wall clock (shifted by [`shift_wall_clock_for_tests`]).
///
/// Backends that keep expiry times by the client's clock (the embedded SQLite
/// file) read this; server-clock backends (PostgreSQL, MySQL, Redis) never
/// read the client's wall clock for expiry.
pub fn wall_now() -> SystemTime {
    let now = SystemTime::now();
    let off = OFFSET_MS.load(Ordering::Relaxed);
    let d = Duration::from_millis(off.unsigned_abs());
    if off >= 0 { now + d } else { now - d }
}

/// Shifts [`wall_now`] by `offset_ms` (negative: behind) for the whole process.
/// For fault tests only.
#[doc(hidden)]
pub fn shift_wall_clock_for_tests(offset_ms: i64) {
    OFFSET_MS.store(offset_ms, Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_offset_shifts_the_clock() {
        shift_wall_clock_for_tests(3_600_000);
        let ahead = wall_now().duration_since(SystemTime::now()).unwrap();
        shift_wall_clock_for_tests(0);
        assert!(ahead >= Duration::from_secs(3599), "{ahead:?}");
    }
}
