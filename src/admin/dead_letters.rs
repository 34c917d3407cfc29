//! Dead letters: listing them page by page, counting, retrying and purging them.

use chrono::{DateTime, Utc};
use tokio_postgres::GenericClient;
use tokio_postgres::types::Type;

use super::subscriptions::require_subscription;
use crate::error::{Error, Grant, Result};
use crate::event::validate_name;
use crate::executor::{Executor, Param, needs_grant, one_row};
use crate::sql;

/// Which dead letters an operation applies to: all of them, or those of one
/// subscription, or of one event, or both.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeadLetterFilter {
    /// Only this subscription's (default: every subscription's).
    pub subscription: Option<String>,
    /// Only this event's, by event id (default: every event's).
    pub event_id: Option<String>,
}

impl DeadLetterFilter {
    /// Every dead letter.
    pub fn all() -> Self {
        DeadLetterFilter::default()
    }

    /// Only the dead letters of `subscription`.
    pub fn subscription(mut self, subscription: impl Into<String>) -> Self {
        self.subscription = Some(subscription.into());
        self
    }

    /// Only the dead letters of the event with this id.
    pub fn event_id(mut self, id: impl Into<String>) -> Self {
        self.event_id = Some(id.into());
        self
    }

    /// `$1 text` subscription and `$2 text` event id (NULL: all), as the dead-letter
    /// statements take them.
    fn params(&self) -> [Param<'_>; 2] {
        [
            (&self.subscription, Type::TEXT),
            (&self.event_id, Type::TEXT),
        ]
    }

    async fn check<C: Executor + ?Sized>(&self, client: &C) -> Result<()> {
        match &self.subscription {
            Some(name) => require_subscription(client, name).await,
            None => Ok(()),
        }
    }
}

/// A delivery that ran out of attempts or failed permanently, from [`dead_letters`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct DeadLetter {
    /// The subscription.
    pub subscription: String,
    /// The event's position in the log.
    pub event_seq: i64,
    /// The event's id (`None` if the event is no longer in the log).
    pub event_id: Option<String>,
    /// The event's name (`None` if the event is no longer in the log).
    pub event_name: Option<String>,
    /// Attempts made.
    pub attempts: i32,
    /// The error of the last attempt.
    pub last_error: Option<String>,
    /// When the last attempt failed (`None` when its history was purged).
    pub failed_at: Option<DateTime<Utc>>,
}

/// A place in the listing of dead letters (oldest event first): the next page starts
/// after it. Written `SEQ/SUBSCRIPTION` (`1042/mailer`), as `pgbus dead list --after`
/// takes it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct DeadLetterCursor {
    event_seq: i64,
    subscription: String,
}

impl DeadLetter {
    /// The place just after this dead letter, for the next page.
    pub fn cursor(&self) -> DeadLetterCursor {
        DeadLetterCursor {
            event_seq: self.event_seq,
            subscription: self.subscription.clone(),
        }
    }
}

impl std::fmt::Display for DeadLetterCursor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.event_seq, self.subscription)
    }
}

impl std::str::FromStr for DeadLetterCursor {
    type Err = Error;

    fn from_str(text: &str) -> Result<Self> {
        let bad = || {
            Error::invalid(
                "dead letter cursor",
                format!("expected SEQ/SUBSCRIPTION (e.g. 1042/mailer), got {text:?}"),
            )
        };
        let (seq, subscription) = text.split_once('/').ok_or_else(bad)?;
        let event_seq = seq.parse().map_err(|_| bad())?;
        validate_name("subscription name", subscription)?;
        Ok(DeadLetterCursor {
            event_seq,
            subscription: subscription.to_string(),
        })
    }
}

/// Lists dead letters, oldest event first, at most `limit`. For the next page, call
/// [`dead_letters_after`] with the last one listed.
///
/// # Errors
///
/// [`Error::UnknownSubscription`] when the filter names a subscription that does not
/// exist; [`Error::Database`] when a statement fails.
pub async fn dead_letters<C: Executor + ?Sized>(
    client: &C,
    filter: &DeadLetterFilter,
    limit: i64,
) -> Result<Vec<DeadLetter>> {
    dead_letters_after(client, filter, limit, None).await
}

/// Lists dead letters after `after` (the last one of the previous page; `None`: from the
/// start), oldest event first, at most `limit`. Each page costs the same however many
/// dead letters there are.
///
/// # Errors
///
/// As [`dead_letters`].
pub async fn dead_letters_after<C: Executor + ?Sized>(
    client: &C,
    filter: &DeadLetterFilter,
    limit: i64,
    after: Option<&DeadLetterCursor>,
) -> Result<Vec<DeadLetter>> {
    filter.check(client).await?;
    let after_seq = after.map(|d| d.event_seq);
    let after_sub = after.map(|d| d.subscription.as_str());
    let rows = client
        .client()
        .query_typed(
            sql::DEAD_LIST,
            &[
                (&filter.subscription, Type::TEXT),
                (&filter.event_id, Type::TEXT),
                (&limit, Type::INT8),
                (&after_seq, Type::INT8),
                (&after_sub, Type::TEXT),
            ],
        )
        .await?;
    rows.iter()
        .map(|row| {
            Ok(DeadLetter {
                subscription: row.try_get("subscription")?,
                event_seq: row.try_get("event_seq")?,
                event_id: row.try_get("event_id")?,
                event_name: row.try_get("event_name")?,
                attempts: row.try_get("attempts")?,
                last_error: row.try_get("last_error")?,
                failed_at: row.try_get("failed_at")?,
            })
        })
        .collect()
}

/// Counts dead letters.
///
/// # Errors
///
/// As [`dead_letters`].
pub async fn count_dead_letters<C: Executor + ?Sized>(
    client: &C,
    filter: &DeadLetterFilter,
) -> Result<i64> {
    count_dead_letters_after(client, filter, None).await
}

/// Counts the dead letters after `after` in the listing's order (see
/// [`dead_letters_after`]): how many more pages hold.
///
/// # Errors
///
/// As [`dead_letters`].
pub async fn count_dead_letters_after<C: Executor + ?Sized>(
    client: &C,
    filter: &DeadLetterFilter,
    after: Option<&DeadLetterCursor>,
) -> Result<i64> {
    filter.check(client).await?;
    let after_seq = after.map(|d| d.event_seq);
    let after_sub = after.map(|d| d.subscription.as_str());
    let row = one_row(
        client.client(),
        sql::DEAD_COUNT,
        &[
            (&filter.subscription, Type::TEXT),
            (&filter.event_id, Type::TEXT),
            (&after_seq, Type::INT8),
            (&after_sub, Type::TEXT),
        ],
    )
    .await?;
    Ok(row.try_get("dead_letters")?)
}

/// Puts dead letters back to pending, due now, with their attempts reset to 0; their
/// failure history is kept. Wakes the listening buses. Returns how many were retried.
///
/// In an ordered subscription a retried dead head is the head again; a retried dead
/// letter that had been skipped waits behind its key's head, or becomes the head of a key
/// that has none.
///
/// # Errors
///
/// As [`dead_letters`]; [`Error::NeedsGrant`] when the role lacks the operator grant
/// (`pgbus.grant_operator`; nothing is changed).
pub async fn retry_dead_letters<C: Executor + ?Sized>(
    client: &C,
    filter: &DeadLetterFilter,
) -> Result<u64> {
    filter.check(client).await?;
    let row = one_row(client.client(), sql::DEAD_RETRY, &filter.params()).await;
    let row = needs_grant(client, "retrying dead letters", Grant::Operator, row).await?;
    // Skipped dead letters of ordered subscriptions come back behind their key's head;
    // a key that has none gets one (a statement of its own: it must see the retry).
    let subs: Option<Vec<String>> = row.try_get("subscriptions")?;
    let keys: Option<Vec<String>> = row.try_get("keys")?;
    if let (Some(subs), Some(keys)) = (subs, keys) {
        client
            .client()
            .query_typed(
                sql::ENSURE_HEADS,
                &[(&subs, Type::TEXT_ARRAY), (&keys, Type::TEXT_ARRAY)],
            )
            .await?;
    }
    Ok(row.try_get::<_, i64>("retried")? as u64)
}

/// What [`purge_dead_letters`] deleted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct Purged {
    /// Dead letters deleted.
    pub dead_letters: u64,
    /// Rows of their failure history deleted.
    pub failures: u64,
}

/// Deletes dead letters for good, with their failure history. The events stay in the log
/// until the retention sweep.
///
/// # Errors
///
/// As [`dead_letters`]; [`Error::NeedsGrant`] when the role lacks the operator grant
/// (`pgbus.grant_operator`; nothing is changed).
pub async fn purge_dead_letters<C: Executor + ?Sized>(
    client: &C,
    filter: &DeadLetterFilter,
) -> Result<Purged> {
    filter.check(client).await?;
    let row = one_row(client.client(), sql::DEAD_PURGE, &filter.params()).await;
    let row = needs_grant(client, "purging dead letters", Grant::Operator, row).await?;
    Ok(Purged {
        dead_letters: row.try_get::<_, i64>("purged")? as u64,
        failures: row.try_get::<_, i64>("failures")? as u64,
    })
}
