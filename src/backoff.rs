//! How the bus's tasks wait after a failure: one jittered exponential backoff for the
//! listener, the claimer and the acker, and a gate that keeps an outage from flooding the
//! log.

use std::time::Duration;

/// The first delay after a failure; it doubles with each further failure.
const FIRST: Duration = Duration::from_millis(50);
/// The longest delay.
const LONGEST: Duration = Duration::from_secs(10);

/// The wait after the `failures`-th failure in a row (1 for the first): exponential from
/// 50 ms, at most `cap` (and never more than 10 s), with full jitter but never under
/// 25 ms, so that many buses failing together do not retry in step.
pub(crate) fn delay(failures: u32, cap: Duration) -> Duration {
    let exp = failures.saturating_sub(1).min(16);
    let ceiling = (FIRST.as_secs_f64() * 2f64.powi(exp as i32))
        .min(LONGEST.as_secs_f64())
        .min(cap.as_secs_f64());
    let floor = (FIRST.as_secs_f64() / 2.0).min(ceiling);
    Duration::from_secs_f64((ceiling * fastrand::f64()).max(floor))
}

/// How often a task may log the start of an outage as a warning.
pub(crate) const WARN_EVERY: Duration = Duration::from_secs(60);

/// Lets a task log the start of an outage as a warning at most once per [`WARN_EVERY`]:
/// a connection that flaps (a connection limit reached and freed many times a second)
/// would otherwise log a warning per flap. What it holds back goes to debug level.
#[derive(Debug, Default)]
pub(crate) struct WarnGate(std::sync::Mutex<Option<tokio::time::Instant>>);

impl WarnGate {
    /// Whether to warn now (and, if so, not again for a while).
    pub(crate) fn allow(&self) -> bool {
        let mut last = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let now = tokio::time::Instant::now();
        if last.is_some_and(|l| now.duration_since(l) < WARN_EVERY) {
            return false;
        }
        *last = Some(now);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_delay_grows_and_stays_within_its_cap() {
        for failures in 0..40 {
            let d = delay(failures, Duration::MAX);
            assert!(d >= FIRST / 2 && d <= LONGEST, "{failures}: {d:?}");
            let capped = delay(failures, Duration::from_millis(250));
            assert!(
                capped <= Duration::from_millis(250),
                "{failures}: {capped:?}"
            );
        }
        // The ceiling doubles: after enough failures some delay exceeds the first one.
        assert!((0..100).any(|_| delay(8, Duration::MAX) > FIRST * 4));
        // A cap below the floor is still respected.
        assert!(delay(3, Duration::from_millis(1)) <= Duration::from_millis(1));
    }
}
