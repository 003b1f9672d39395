//! Jittered exponential backoff for backends that have no notification.

use std::time::Duration;

use tokio::time::Instant;

/// Jittered exponential backoff ("full jitter": each sleep is uniform in
/// `[min, cap]`, and the cap doubles per attempt up to `max`).
///
/// The jitter keeps polling waiters from retrying in lock-step (the herd); the
/// cap keeps the delay a waiter adds after a release bounded.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use fencelock_core::backend::Backoff;
///
/// let mut b = Backoff::new(Duration::from_millis(1), Duration::from_millis(50));
/// for _ in 0..20 {
///     let d = b.next_delay();
///     assert!(d >= Duration::from_millis(1) && d <= Duration::from_millis(50));
/// }
/// ```
#[derive(Debug, Clone)]
pub struct Backoff {
    min: Duration,
    max: Duration,
    cap: Duration,
    attempts: u32,
}

impl Default for Backoff {
    /// 1 ms growing to 100 ms.
    fn default() -> Self {
        Backoff::new(Duration::from_millis(1), Duration::from_millis(100))
    }
}

impl Backoff {
    /// A backoff whose delays lie in `[min, max]`.
    pub fn new(min: Duration, max: Duration) -> Self {
        let max = max.max(min);
        Backoff {
            min,
            max,
            cap: (min * 2).min(max),
            attempts: 0,
        }
    }

    /// How many delays were handed out since the last [`Backoff::reset`].
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// Starts over from the smallest delay.
    pub fn reset(&mut self) {
        self.cap = (self.min * 2).min(self.max);
        self.attempts = 0;
    }

    /// The next delay: uniform in `[min, cap]`; the cap then doubles.
    pub fn next_delay(&mut self) -> Duration {
        let lo = self.min.as_micros() as u64;
        let hi = self.cap.as_micros() as u64;
        let d = Duration::from_micros(fastrand::u64(lo..=hi.max(lo)));
        self.cap = (self.cap * 2).min(self.max);
        self.attempts = self.attempts.saturating_add(1);
        d
    }

    /// Sleeps for [`Backoff::next_delay`], but not past `deadline` nor past `hint`
    /// (for example the time left of the current holder's lease).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping the future only cuts the sleep short.
    pub async fn sleep(&mut self, deadline: Option<Instant>, hint: Option<Duration>) {
        let mut d = self.next_delay();
        if let Some(h) = hint {
            d = d.min(h.max(self.min));
        }
        let mut until = Instant::now() + d;
        if let Some(dl) = deadline {
            until = until.min(dl);
        }
        crate::sync::sleep_until(until).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cap_grows_then_stays() {
        let mut b = Backoff::new(Duration::from_millis(2), Duration::from_millis(16));
        for _ in 0..10 {
            b.next_delay();
        }
        assert_eq!(b.cap, Duration::from_millis(16));
        b.reset();
        assert_eq!(b.cap, Duration::from_millis(4));
        assert_eq!(b.attempts(), 0);
    }
}
