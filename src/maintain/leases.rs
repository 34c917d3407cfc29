//! Leases: returning expired ones (of any bus) to pending or the dead letters, and
//! extending the ones this bus holds.

use tokio_postgres::types::{ToSql, Type};
use tokio_util::sync::CancellationToken;

use crate::error::Error;
use crate::sql;
use crate::stats;

use super::{Maintainer, ROWS_PER_DUTY};

impl Maintainer {
    /// Returns expired leases (of any bus) to pending or the dead letters; how many, or
    /// `None` when it failed (or the bus is stopping).
    pub(super) async fn reap(&self) -> Option<i64> {
        let reaped = async {
            let client = self.client().await?;
            let work = async {
                let rows = self
                    .db()
                    .query(&client, sql::REAP, &[Type::INT4], &[&ROWS_PER_DUTY])
                    .await?;
                let row = rows
                    .first()
                    .ok_or(Error::Unexpected("the reaper returned no row"))?;
                Ok((
                    row.try_get::<_, i64>("returned")?,
                    row.try_get::<_, i64>("dead")?,
                ))
            };
            self.db()
                .unless_stopped(&client, self.shutdown.token(), work)
                .await
                .transpose()
        };
        stats::add(&self.stats.reaps, 1);
        match reaped.await {
            Ok(Some((pending, dead))) => {
                if pending + dead > 0 {
                    self.stats.leases_expired((pending + dead) as u64);
                    tracing::info!(returned = pending, dead, "pgbus reaped expired leases");
                }
                if pending > 0 {
                    self.wake.now();
                }
                Some(pending + dead)
            }
            Ok(None) => None,
            Err(e) => {
                tracing::debug!(error = %e, "pgbus reaper failed");
                None
            }
        }
    }

    /// Extends the leases of every delivery this bus still holds.
    pub(super) async fn extend(&self, stop: &CancellationToken) {
        let held = self.slots.held();
        if held.is_empty() {
            return;
        }
        let extended = async {
            let client = self.client().await?;
            let subs: Vec<&str> = held.iter().map(|(s, _, _)| &**s).collect();
            let seqs: Vec<i64> = held.iter().map(|(_, q, _)| *q).collect();
            let attempts: Vec<i32> = held.iter().map(|(_, _, a)| *a).collect();
            let lease_ms = self.schedule.lease.as_millis() as i64;
            let worker: &str = &self.consumer.worker;
            let params: [&(dyn ToSql + Sync); 5] = [&subs, &seqs, &attempts, &lease_ms, &worker];
            let work = self.db().query(
                &client,
                sql::EXTEND,
                &[
                    Type::TEXT_ARRAY,
                    Type::INT8_ARRAY,
                    Type::INT4_ARRAY,
                    Type::INT8,
                    Type::TEXT,
                ],
                &params,
            );
            self.db()
                .unless_stopped(&client, stop, work)
                .await
                .transpose()
        };
        if let Err(e) = extended.await {
            crate::warn_limited!(gate = &self.lease_warn; error = %e, "pgbus could not extend leases");
        }
    }
}
