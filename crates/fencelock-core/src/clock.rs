//! The wall clock that backends read for fencing-token floors, with a hook
//! (behind the `test-hooks` feature) that lets fault tests shift it: a client
//! whose clock is off.

use std::time::SystemTime;

#[cfg(feature = "test-hooks")]
static OFFSET_MS: std::sync::atomic::AtomicI64 = std::sync::atomic::AtomicI64::new(0);

/// Now by this process's wall clock (shifted by `shift_wall_clock_for_tests`
/// in builds with the `test-hooks` feature).
///
/// No backend keeps expiry times by the client's wall clock: the embedded
/// SQLite file counts expiry on the machine's boot-time clock, and server
/// backends (PostgreSQL, MySQL, Redis) on the server's. SQLite floors its
/// tokens at this clock.
pub fn wall_now() -> SystemTime {
    let now = SystemTime::now();
    #[cfg(feature = "test-hooks")]
    {
        let off = OFFSET_MS.load(std::sync::atomic::Ordering::Relaxed);
        let d = std::time::Duration::from_millis(off.unsigned_abs());
        if off >= 0 { now + d } else { now - d }
    }
    #[cfg(not(feature = "test-hooks"))]
    now
}

/// Shifts [`wall_now`] by `offset_ms` (negative: behind) for the whole process.
/// For fault tests only: it exists only with the `test-hooks` feature, which
/// the testkit enables.
#[cfg(feature = "test-hooks")]
pub fn shift_wall_clock_for_tests(offset_ms: i64) {
    OFFSET_MS.store(offset_ms, std::sync::atomic::Ordering::Relaxed);
}

#[cfg(all(test, feature = "test-hooks"))]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn the_offset_shifts_the_clock() {
        shift_wall_clock_for_tests(3_600_000);
        let ahead = wall_now().duration_since(SystemTime::now()).unwrap();
        shift_wall_clock_for_tests(0);
        assert!(ahead >= Duration::from_secs(3599), "{ahead:?}");
    }
}
