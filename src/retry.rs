//! Retry policy: exponential backoff with full jitter, and the maximum attempts.

use std::time::Duration;

/// Default first retry delay: 1 s.
pub const DEFAULT_RETRY_BASE: Duration = Duration::from_secs(1);
/// Default growth factor between attempts: 2.
pub const DEFAULT_RETRY_FACTOR: f64 = 2.0;
/// Default longest delay: 1 hour.
pub const DEFAULT_RETRY_CAP: Duration = Duration::from_secs(3600);
/// Default maximum attempts (claims) of one delivery before it is dead-lettered: 25.
pub const DEFAULT_MAX_ATTEMPTS: i32 = 25;
/// The longest delay before a retry: 365 days.
///
/// Every retry delay is clamped to it: a [`RetryPolicy`]'s cap and fixed delay,
/// [`HandlerError::retry_after`](crate::HandlerError::retry_after) and
/// [`Delivery::retry_in`](crate::Delivery::retry_in). A longer delay (up to
/// `Duration::MAX`) is not an error; the retry is simply scheduled this far ahead. The
/// bound keeps `now() + delay` inside PostgreSQL's `interval` and `timestamptz` ranges,
/// so no delay can make the statement that records the failure fail.
pub const MAX_RETRY_DELAY: Duration = Duration::from_secs(365 * 24 * 3600);

/// `delay`, or [`MAX_RETRY_DELAY`] when it is longer.
pub(crate) fn clamp_delay(delay: Duration) -> Duration {
    delay.min(MAX_RETRY_DELAY)
}

/// How failed deliveries are retried.
///
/// The delay after attempt `n` (1-based) is drawn uniformly from
/// `[0, min(cap, base * factor^(n-1))]` ("full jitter"), so a crowd of failures spreads
/// out instead of retrying in lockstep. Attempts count claims: a delivery whose worker
/// crashes counts an attempt too, so a poison event ends as a dead letter after
/// `max_attempts` instead of looping forever. No delay exceeds [`MAX_RETRY_DELAY`].
///
/// ```
/// use std::time::Duration;
/// use pgbus::RetryPolicy;
///
/// let policy = RetryPolicy::exponential(Duration::from_millis(500)).max_attempts(10);
/// assert!(policy.delay(3) <= Duration::from_secs(2));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct RetryPolicy {
    base: Duration,
    factor: f64,
    cap: Duration,
    max_attempts: i32,
    /// Whether `max_attempts` was set: a bus joining a stored subscription follows the
    /// stored maximum unless it was.
    attempts_set: bool,
    jitter: bool,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            base: DEFAULT_RETRY_BASE,
            factor: DEFAULT_RETRY_FACTOR,
            cap: DEFAULT_RETRY_CAP,
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            attempts_set: false,
            jitter: true,
        }
    }
}

impl RetryPolicy {
    /// Exponential backoff from `base`, doubling, capped at 1 hour, 25 attempts, full
    /// jitter.
    pub fn exponential(base: Duration) -> Self {
        RetryPolicy {
            base,
            ..RetryPolicy::default()
        }
    }

    /// The same delay after every failure (no growth, no jitter), at most
    /// [`MAX_RETRY_DELAY`].
    pub fn fixed(delay: Duration) -> Self {
        let delay = clamp_delay(delay);
        RetryPolicy {
            base: delay,
            factor: 1.0,
            cap: delay,
            jitter: false,
            ..RetryPolicy::default()
        }
    }

    /// Sets the growth factor (default 2; values below 1 are treated as 1).
    pub fn factor(mut self, factor: f64) -> Self {
        self.factor = if factor.is_finite() {
            factor.max(1.0)
        } else {
            1.0
        };
        self
    }

    /// Sets the longest delay (default 1 hour; at most [`MAX_RETRY_DELAY`], to which a
    /// longer cap is clamped).
    pub fn cap(mut self, cap: Duration) -> Self {
        self.cap = clamp_delay(cap);
        self
    }

    /// Sets the maximum attempts (default 25; at least 1).
    pub fn max_attempts(mut self, attempts: i32) -> Self {
        self.max_attempts = attempts.max(1);
        self.attempts_set = true;
        self
    }

    /// Turns full jitter on or off (default on).
    pub fn jitter(mut self, jitter: bool) -> Self {
        self.jitter = jitter;
        self
    }

    /// The maximum attempts.
    pub fn attempts(&self) -> i32 {
        self.max_attempts
    }

    /// The maximum attempts if [`RetryPolicy::max_attempts`] set them, else `None`.
    pub(crate) fn attempts_if_set(&self) -> Option<i32> {
        self.attempts_set.then_some(self.max_attempts)
    }

    /// The delay before the retry that follows failed attempt `attempt` (1-based).
    pub fn delay(&self, attempt: i32) -> Duration {
        let exp = (attempt.max(1) - 1).min(1000);
        let ceiling = if self.base.is_zero() {
            0.0 // never 0 * inf
        } else {
            self.base.as_secs_f64() * self.factor.powi(exp)
        };
        let ceiling = ceiling.min(self.cap.as_secs_f64()).max(0.0);
        let secs = if self.jitter {
            ceiling * fastrand::f64()
        } else {
            ceiling
        };
        Duration::from_secs_f64(secs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_grow_and_are_capped() {
        let p = RetryPolicy::exponential(Duration::from_secs(1))
            .jitter(false)
            .cap(Duration::from_secs(10));
        assert_eq!(p.delay(1), Duration::from_secs(1));
        assert_eq!(p.delay(2), Duration::from_secs(2));
        assert_eq!(p.delay(4), Duration::from_secs(8));
        assert_eq!(p.delay(5), Duration::from_secs(10));
        assert_eq!(p.delay(500), Duration::from_secs(10));
    }

    #[test]
    fn jitter_stays_within_the_ceiling() {
        let p = RetryPolicy::exponential(Duration::from_millis(100));
        for attempt in 1..30 {
            assert!(p.delay(attempt) <= DEFAULT_RETRY_CAP);
        }
        assert!(p.delay(1) <= Duration::from_millis(100));
    }

    #[test]
    fn delays_never_exceed_the_maximum() {
        let p = RetryPolicy::exponential(Duration::MAX)
            .cap(Duration::MAX)
            .factor(f64::MAX)
            .jitter(false);
        assert_eq!(p.delay(1), MAX_RETRY_DELAY);
        assert_eq!(p.delay(i32::MAX), MAX_RETRY_DELAY);
        let p = RetryPolicy::fixed(Duration::MAX);
        assert_eq!(p.delay(1), MAX_RETRY_DELAY);
        assert_eq!(p.delay(7), MAX_RETRY_DELAY);
        let p = RetryPolicy::fixed(Duration::from_secs(10u64.pow(12)));
        assert_eq!(p.delay(3), MAX_RETRY_DELAY);
        // Within the maximum, nothing changes.
        let p = RetryPolicy::fixed(MAX_RETRY_DELAY - Duration::from_secs(1));
        assert_eq!(p.delay(1), MAX_RETRY_DELAY - Duration::from_secs(1));
        assert_eq!(clamp_delay(Duration::ZERO), Duration::ZERO);
        let p = RetryPolicy::exponential(Duration::ZERO)
            .factor(f64::MAX)
            .jitter(false);
        assert_eq!(p.delay(500), Duration::ZERO);
        assert_eq!(clamp_delay(Duration::MAX), MAX_RETRY_DELAY);
    }

    #[test]
    fn the_maximum_fits_in_a_postgres_interval_in_milliseconds() {
        // The settle statement computes now() + delay_ms * interval '1 millisecond'.
        let ms = MAX_RETRY_DELAY.as_millis();
        assert!(ms.checked_mul(1000).is_some_and(|us| us < i64::MAX as u128));
    }

    #[test]
    fn fixed_is_fixed() {
        let p = RetryPolicy::fixed(Duration::from_millis(250));
        assert_eq!(p.delay(1), Duration::from_millis(250));
        assert_eq!(p.delay(9), Duration::from_millis(250));
    }
}
