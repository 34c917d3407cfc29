//! Ordering repair: keys of ordered subscriptions left without a head get one.

use tokio_postgres::types::Type;

use crate::sql;
use crate::stats;

use super::{Maintainer, ROWS_PER_DUTY};

impl Maintainer {
    /// Repairs keys of ordered subscriptions left without a head.
    pub(super) async fn repair(&self) {
        let repaired = async {
            let client = self.client().await?;
            let work = self
                .db()
                .query(&client, sql::REPAIR, &[Type::INT4], &[&ROWS_PER_DUTY]);
            self.db()
                .unless_stopped(&client, self.shutdown.token(), work)
                .await
                .transpose()
        };
        match repaired.await {
            Ok(Some(rows)) if !rows.is_empty() => {
                for row in &rows {
                    tracing::error!(
                        messaging.destination.subscription.name =
                            row.try_get::<_, &str>("subscription").unwrap_or_default(),
                        pgbus.ordering_key =
                            row.try_get::<_, &str>("ordering_key").unwrap_or_default(),
                        pgbus.event_seq = row.try_get::<_, i64>("event_seq").unwrap_or_default(),
                        "pgbus repaired an ordering key that had no head"
                    );
                }
                stats::add(&self.stats.repaired, rows.len() as u64);
                self.wake.now();
            }
            Ok(_) => {}
            Err(e) => tracing::debug!(error = %e, "pgbus ordering repair failed"),
        }
    }
}
