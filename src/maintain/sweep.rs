//! The retention sweep, run by the leader one batch at a time.

use tokio::time::Instant;

use super::SWEEP_INTERVAL;

use super::Maintainer;

impl Maintainer {
    /// Runs one retention sweep batch; returns when the next one is due.
    pub(super) async fn sweep(&self) -> Instant {
        let later = Instant::now() + SWEEP_INTERVAL;
        let Some(retention) = self.schedule.retention else {
            return later;
        };
        let batch = crate::retention::DEFAULT_SWEEP_BATCH;
        let swept = async {
            let client = self.client().await?;
            let work = self.db().with_settings(
                &client,
                crate::retention::sweep_batch(&**client, retention, batch),
            );
            self.db()
                .unless_stopped(&client, self.shutdown.token(), work)
                .await
                .transpose()
        };
        match swept.await {
            Ok(Some(swept)) => {
                if swept.events > 0 {
                    tracing::info!(
                        events = swept.events,
                        failures = swept.failures,
                        "pgbus swept events past retention"
                    );
                }
                if swept.events >= batch as u64 {
                    Instant::now()
                } else {
                    later
                }
            }
            Ok(None) => later,
            Err(e) => {
                crate::warn_limited!(error = %e, "pgbus retention sweep failed");
                later
            }
        }
    }
}
