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

/// How often one kind of warning may be logged: the first is, then at most one per
/// interval, which says how many were held back meanwhile.
pub const WARN_EVERY: Duration = Duration::from_secs(60);

/// A rate limiter for one kind of warning: the first occurrence may be logged, then at
/// most one per [`WARN_EVERY`], and that one says how many it held back (`suppressed`).
/// A connection that flaps (a connection limit reached and freed many times a second),
/// an outage that every pooled connection notices, a handler that panics on every
/// delivery would otherwise log a line per occurrence. What it holds back goes to debug
/// level. [`warn_limited!`](crate::warn_limited) logs through one.
#[derive(Debug, Default)]
pub struct WarnGate(std::sync::Mutex<GateState>);

#[derive(Debug, Default)]
struct GateState {
    /// When the last warning was let through.
    last: Option<tokio::time::Instant>,
    /// Occurrences held back since.
    suppressed: u64,
}

impl WarnGate {
    /// A gate that has let nothing through yet.
    pub const fn new() -> Self {
        WarnGate(std::sync::Mutex::new(GateState {
            last: None,
            suppressed: 0,
        }))
    }

    /// Whether to warn now (and, if so, not again for a while).
    pub fn allow(&self) -> bool {
        self.pass().is_some()
    }

    /// `Some(held back)` when a warning may be logged now, with the number of
    /// occurrences held back since the last one let through; `None` (one more held back)
    /// when one was let through less than [`WARN_EVERY`] ago.
    pub fn pass(&self) -> Option<u64> {
        self.pass_at(tokio::time::Instant::now())
    }

    /// [`pass`](Self::pass) at the time `now`.
    fn pass_at(&self, now: tokio::time::Instant) -> Option<u64> {
        let mut state = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if state
            .last
            .is_some_and(|l| now.duration_since(l) < WARN_EVERY)
        {
            state.suppressed += 1;
            return None;
        }
        state.last = Some(now);
        Some(std::mem::take(&mut state.suppressed))
    }
}

/// Logs a warning through a [`WarnGate`]: the first occurrence, then at most one per
/// [`WARN_EVERY`] with a `suppressed` field (how many were held back since); the others
/// at debug level. The arguments are `tracing::warn!`'s. Without `gate = ...;` the gate
/// is the call site's own (one per kind of warning, for the whole process); with it, the
/// given one (e.g. one per task).
#[doc(hidden)]
#[macro_export]
macro_rules! warn_limited {
    (gate = $gate:expr; $($arg:tt)+) => {
        match $crate::__private::WarnGate::pass($gate) {
            ::std::option::Option::Some(suppressed) => {
                $crate::__private::tracing::warn!(suppressed, $($arg)+)
            }
            ::std::option::Option::None => $crate::__private::tracing::debug!($($arg)+),
        }
    };
    ($($arg:tt)+) => {{
        static GATE: $crate::__private::WarnGate = $crate::__private::WarnGate::new();
        $crate::warn_limited!(gate = &GATE; $($arg)+)
    }};
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

    #[test]
    fn a_gate_lets_one_through_per_interval_and_counts_the_rest() {
        let gate = WarnGate::new();
        let start = tokio::time::Instant::now();
        assert_eq!(gate.pass_at(start), Some(0));
        assert_eq!(gate.pass_at(start), None);
        assert_eq!(gate.pass_at(start + WARN_EVERY / 2), None);
        assert_eq!(
            gate.pass_at(start + WARN_EVERY),
            Some(2),
            "the two held back"
        );
        assert_eq!(gate.pass_at(start + WARN_EVERY), None);
        assert_eq!(gate.pass_at(start + WARN_EVERY * 3), Some(1));
    }
}
