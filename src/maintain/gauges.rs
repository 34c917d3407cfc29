//! The backlog gauges, the fan-out backlog and the xmin horizon, sampled by the leader,
//! and the long-transaction warning.

use crate::sql;

use super::Maintainer;

impl Maintainer {
    /// Samples the backlog gauges of every live bus's subscriptions
    /// ([`sql::BACKLOG_LIVE`]), the events not yet turned into deliveries
    /// ([`sql::FAN_OUT_BACKLOG`]) and what holds the xmin horizon back
    /// ([`sql::XMIN_HORIZON`]), in one transaction, and sets them on the installed
    /// recorder; warns (rate-limited) when the oldest transaction is older than the
    /// schedule's threshold.
    pub(super) async fn sample_gauges(&self) {
        let client = match self.client().await {
            Ok(client) => client,
            Err(e) => return tracing::debug!(error = %e, "pgbus could not sample the gauges"),
        };
        let subs: Vec<&str> = self.consumer.subscriptions.iter().map(|s| &**s).collect();
        let cap = crate::metrics::GAUGE_COUNT_CAP;
        let sampled = async {
            let work = self.db().in_one_transaction(&client, async {
                let backlog = self
                    .db()
                    .query(
                        &client,
                        sql::BACKLOG_LIVE,
                        &sql::BACKLOG_TYPES,
                        &[&subs, &cap],
                    )
                    .await?;
                let fan_out = self
                    .db()
                    .query(
                        &client,
                        sql::FAN_OUT_BACKLOG,
                        &sql::FAN_OUT_BACKLOG_TYPES,
                        &[&cap],
                    )
                    .await?;
                let horizon = self
                    .db()
                    .query(&client, sql::XMIN_HORIZON, &[], &[])
                    .await?;
                Ok((backlog, fan_out, horizon))
            });
            self.db()
                .unless_stopped(&client, self.shutdown.token(), work)
                .await
                .transpose()
        };
        let (backlog, fan_out, horizon) = match sampled.await {
            Ok(Some(rows)) => rows,
            Ok(None) => {
                // Cancelled inside its transaction: the connection is not given back.
                drop(deadpool_postgres::Object::take(client));
                return;
            }
            Err(e) => return tracing::debug!(error = %e, "pgbus could not sample the gauges"),
        };
        for row in &backlog {
            match crate::metrics::Backlog::from_row(row) {
                Ok(backlog) => backlog.record(),
                Err(e) => tracing::debug!(error = %e, "pgbus cannot read a gauge sample"),
            }
        }
        match fan_out.first().map(crate::metrics::FanOutBacklog::from_row) {
            Some(Ok(backlog)) => backlog.record(),
            Some(Err(e)) => tracing::debug!(error = %e, "pgbus cannot read a gauge sample"),
            None => {}
        }
        let horizon = match horizon.first().map(crate::metrics::XminHorizon::from_row) {
            Some(Ok(horizon)) => horizon,
            Some(Err(e)) => return tracing::debug!(error = %e, "pgbus cannot read the horizon"),
            None => return,
        };
        horizon.record();
        if let Some(threshold) = self.schedule.long_transaction
            && horizon.older_than(threshold)
        {
            crate::warn_limited!(
                age_seconds = horizon.oldest_transaction_age.unwrap_or_default().round() as i64,
                transaction = horizon.oldest_transaction.as_deref().unwrap_or(""),
                "pgbus sees a long transaction holding the xmin horizon back: VACUUM cannot \
                 remove settled deliveries until it ends, and claims slow down (end it, or \
                 see docs/operations.md, \"A long transaction\")"
            );
        }
    }
}
