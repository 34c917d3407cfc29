//! Replay: new deliveries of events already in the log, for one subscription.

use chrono::{DateTime, Utc};
use tokio_postgres::types::Type;

use crate::error::{Error, Grant, Result};
use crate::event::validate_pattern;
use crate::executor::{Executor, needs_grant, one_row};
use crate::sql;

/// What [`replay`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct Replayed {
    /// Events in the range that the subscription (and the pattern, if any) matches.
    pub matched: u64,
    /// Deliveries created: the matched events the subscription had no delivery of.
    pub created: u64,
}

/// Delivers again, to one subscription, the events still in the log that were published
/// in `[since, until)` (by `created_at`) and match the subscription's patterns, and
/// `pattern` too when given. Events the subscription still has a delivery of (pending,
/// processing or dead) are skipped. Wakes the listening buses. In an ordered
/// subscription, replayed events keep their key's order: each joins its key behind what
/// is already waiting, in event order.
///
/// One statement: replaying millions of events is one long transaction.
///
/// # Errors
///
/// [`Error::Invalid`] for a bad pattern or an `until` not after `since` (nothing is
/// written), [`Error::UnknownSubscription`] when there is no
/// such subscription, [`Error::NeedsGrant`] when the role lacks the operator grant
/// (`pgbus.grant_operator`), [`Error::Database`] when the statement fails.
pub async fn replay<C: Executor + ?Sized>(
    client: &C,
    subscription: &str,
    since: DateTime<Utc>,
    until: Option<DateTime<Utc>>,
    pattern: Option<&str>,
) -> Result<Replayed> {
    if let Some(p) = pattern {
        validate_pattern(p)?;
    }
    if let Some(until) = until
        && until <= since
    {
        return Err(Error::invalid(
            "replay range",
            format!("until ({until}) must be after since ({since})"),
        ));
    }
    let row = one_row(
        client.client(),
        sql::REPLAY,
        &[
            (&subscription, Type::TEXT),
            (&since, Type::TIMESTAMPTZ),
            (&until, Type::TIMESTAMPTZ),
            (&pattern, Type::TEXT),
        ],
    )
    .await;
    let row = needs_grant(client, "replaying events", Grant::Operator, row).await?;
    if !row.try_get::<_, bool>("found")? {
        return Err(Error::UnknownSubscription {
            name: subscription.to_string(),
        });
    }
    Ok(Replayed {
        matched: row.try_get::<_, i64>("matched")? as u64,
        created: row.try_get::<_, i64>("created")? as u64,
    })
}
