//! The bus's stop signal and the one deadline that bounds a graceful stop.

use std::sync::OnceLock;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::{CancellationToken, WaitForCancellationFuture};

/// How much of the shutdown timeout is kept for writing the last settlements once the
/// handlers' time is up: a quarter, at most one second.
const SETTLE_RESERVE: Duration = Duration::from_secs(1);

/// Stopping: a token every task watches, the deadlines of the stop once it began, and a
/// second token for when the handlers' time is up.
#[derive(Debug, Default)]
pub(crate) struct Shutdown {
    token: CancellationToken,
    overdue: CancellationToken,
    /// The stop's deadline, and the handlers' (the deadline less the reserve).
    deadlines: OnceLock<(Instant, Instant)>,
}

impl Shutdown {
    /// Begins the stop, to end by `timeout` from now (the first call sets the deadlines);
    /// returns the stop's deadline and the handlers'.
    pub(crate) fn begin(&self, timeout: Duration) -> (Instant, Instant) {
        let deadlines = *self.deadlines.get_or_init(|| {
            let deadline = Instant::now() + timeout;
            (deadline, deadline - (timeout / 4).min(SETTLE_RESERVE))
        });
        self.token.cancel();
        deadlines
    }

    pub(crate) fn is_stopping(&self) -> bool {
        self.token.is_cancelled()
    }

    pub(crate) fn stopping(&self) -> WaitForCancellationFuture<'_> {
        self.token.cancelled()
    }

    pub(crate) fn token(&self) -> &CancellationToken {
        &self.token
    }

    /// Cancelled when the handlers' time is up: a claim still in flight then (blocked on
    /// a lock, say) is cancelled rather than waited for. Earlier, a claim that completes
    /// during the stop hands its deliveries over to be released.
    pub(crate) fn overdue(&self) -> &CancellationToken {
        &self.overdue
    }

    /// When running handlers must be done: the deadline less the reserve for the last
    /// settlements (now, if the stop has not begun).
    pub(crate) fn handlers_deadline(&self) -> Instant {
        self.deadlines
            .get()
            .map_or_else(Instant::now, |&(_, handlers)| handlers)
    }
}
