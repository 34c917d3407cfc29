//! The retention sweep: deleting events older than the retention that no delivery
//! refers to, with their failure history, in batches.
//!
//! A running bus sweeps on its own (the elected leader, every
//! [`BusBuilder::retention`](crate::BusBuilder::retention) period);
//! [`admin::sweep`](crate::admin::sweep) is the same sweep for an operator or a cron job.

use std::time::Duration;

use tokio_postgres::types::Type;

use crate::error::{Error, Result};
use crate::executor::{Executor, one_row};
use crate::sql;

/// Default retention of the log: 7 days. Events older than this that no delivery refers
/// to are deleted by the sweep.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);

/// Default number of events one sweep batch deletes: 1,000.
pub const DEFAULT_SWEEP_BATCH: i32 = 1000;

/// What a retention sweep did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct Swept {
    /// Events deleted from the log.
    pub events: u64,
    /// Rows of failure history deleted with them.
    pub failures: u64,
    /// Batches run (statements that deleted something, plus the last one).
    pub batches: u64,
    /// Another process was sweeping, so this one stopped.
    pub busy: bool,
}

fn retention_millis(retention: Duration) -> Result<i64> {
    if retention.is_zero() {
        return Err(Error::invalid("retention", "must be positive"));
    }
    i64::try_from(retention.as_millis()).map_err(|_| Error::invalid("retention", "is too long"))
}

/// One batch of the retention sweep: deletes at most `batch` events created more than
/// `retention` ago that no delivery refers to, oldest first, with their failure history.
///
/// At most one sweep batch runs at a time across every process (the sweep's row in
/// `pgbus.duties`, locked until the batch commits); when another holds it, this one
/// deletes nothing and reports `busy`.
/// The bus runs this periodically (see [`BusBuilder::retention`](crate::BusBuilder::retention)).
///
/// # Errors
///
/// [`Error::Invalid`] for a zero retention or batch, [`Error::Database`] when the
/// statement fails.
pub async fn sweep_batch<C: Executor + ?Sized>(
    client: &C,
    retention: Duration,
    batch: i32,
) -> Result<Swept> {
    let retention_ms = retention_millis(retention)?;
    if batch < 1 {
        return Err(Error::invalid("sweep batch", "must be at least 1"));
    }
    let row = one_row(
        client.client(),
        sql::SWEEP,
        &[(&retention_ms, Type::INT8), (&batch, Type::INT4)],
    )
    .await?;
    Ok(Swept {
        busy: !row.try_get::<_, bool>("got")?,
        events: row.try_get::<_, i64>("events")? as u64,
        failures: row.try_get::<_, i64>("failures")? as u64,
        batches: 1,
    })
}

/// The whole retention sweep: runs [`sweep_batch`] until a batch comes back short (or
/// another process is sweeping). Given a client, each batch commits on its own, so locks
/// are held briefly; given a transaction, everything commits with it.
///
/// # Errors
///
/// As [`sweep_batch`]; batches already committed stay committed.
pub async fn sweep<C: Executor + ?Sized>(
    client: &C,
    retention: Duration,
    batch: i32,
) -> Result<Swept> {
    let mut total = Swept::default();
    loop {
        let one = sweep_batch(client, retention, batch).await?;
        total.events += one.events;
        total.failures += one.failures;
        total.batches += 1;
        total.busy = one.busy;
        if one.busy || one.events < batch as u64 {
            return Ok(total);
        }
    }
}
