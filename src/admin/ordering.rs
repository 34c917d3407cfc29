//! Ordered subscriptions: per-key order without blocking other keys.
//!
//! An ordered subscription delivers the events of one ordering key (by default the
//! aggregate, `"type:id"`; see [`Event::ordering_key`](crate::Event::ordering_key)) one at
//! a time, in the order their publishing transactions committed, while every other key
//! keeps flowing. Only the oldest unfinished delivery of a key (its head) is claimable.
//! A failing head backs off and only its key waits. A head that dies either blocks its key
//! until an operator acts ([`DeadHeadPolicy::Block`], the default) or is skipped
//! ([`DeadHeadPolicy::Skip`]).
//!
//! Order is kept per key across transactions that publish to it concurrently: fan-out and
//! completion lock each (subscription, key) until their transaction ends, in sorted
//! order: a row lock on the key's stripe of `pgbus.key_stripes`, which no role outside
//! pgbus can take. A transaction that publishes to several keys in separate statements
//! should touch them in a consistent order (or publish them in one batch), as with any
//! locks; two different keys may share a stripe, so a deadlock between such
//! transactions, which PostgreSQL detects and fails (40P01), stays possible.

use tokio_postgres::GenericClient;
use tokio_postgres::types::{ToSql, Type};

use crate::error::{Grant, Result};
use crate::executor::{Executor, needs_grant};
use crate::sql;

pub use crate::subscription::DeadHeadPolicy;

/// Makes a registered subscription ordered or unordered, with its dead-head policy
/// (a shorthand for [`admin::configure_subscription`](crate::admin::configure_subscription),
/// safe while publishers and consumers run). Turning ordering on gives each key one head,
/// its oldest waiting delivery; turning it off makes every waiting delivery claimable at
/// once. Does nothing when there is no such subscription.
///
/// # Errors
///
/// [`Error::Database`](crate::Error::Database) when the statement fails.
pub async fn set_ordering<C: Executor + ?Sized>(
    client: &C,
    subscription: &str,
    ordered: bool,
    on_dead: DeadHeadPolicy,
) -> Result<()> {
    let change = crate::subscription::SubscriptionChange::new()
        .ordered(ordered)
        .on_dead(on_dead);
    crate::subscription::configure_subscription(client, subscription, &change).await?;
    Ok(())
}

/// A key of an ordered subscription whose head is a dead letter.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct BlockedKey {
    /// The subscription.
    pub subscription: String,
    /// The ordering key.
    pub key: String,
    /// The dead head's event id.
    pub event_id: String,
    /// The dead head's event name.
    pub event_name: String,
    /// Attempts the head used.
    pub attempts: i32,
    /// The head's last error.
    pub last_error: Option<String>,
    /// Deliveries of this key waiting behind it.
    pub waiting: i64,
}

/// Lists keys blocked by a dead head (`on_dead = block`), optionally of one subscription.
///
/// # Errors
///
/// [`Error::Database`](crate::Error::Database) when the query fails.
pub async fn blocked_keys<C: Executor + ?Sized>(
    client: &C,
    subscription: Option<&str>,
) -> Result<Vec<BlockedKey>> {
    let params: [(&(dyn ToSql + Sync), Type); 1] = [(&subscription, Type::TEXT)];
    let rows = client
        .client()
        .query_typed(sql::BLOCKED_KEYS, &params)
        .await?;
    rows.iter()
        .map(|r| {
            Ok(BlockedKey {
                subscription: r.try_get("subscription")?,
                key: r.try_get("key")?,
                event_id: r.try_get("event_id")?,
                event_name: r.try_get("event_name")?,
                attempts: r.try_get("attempts")?,
                last_error: r.try_get("last_error")?,
                waiting: r.try_get("waiting")?,
            })
        })
        .collect()
}

/// A delivery waiting behind its key's head, from [`waiting_behind`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct WaitingDelivery {
    /// The ordering key.
    pub key: String,
    /// The event's position in the log.
    pub event_seq: i64,
    /// The event's id.
    pub event_id: String,
    /// The event's name.
    pub event_name: String,
    /// When it is due once it is the head.
    pub available_at: chrono::DateTime<chrono::Utc>,
}

/// What waits behind the heads of `keys` of an ordered subscription, by key and in the
/// order it will be delivered, at most `per_key` deliveries of each key.
///
/// # Errors
///
/// [`Error::Database`](crate::Error::Database) when the statement fails.
pub async fn waiting_behind<C: Executor + ?Sized>(
    client: &C,
    subscription: &str,
    keys: &[&str],
    per_key: i64,
) -> Result<Vec<WaitingDelivery>> {
    let params: [(&(dyn ToSql + Sync), Type); 3] = [
        (&subscription, Type::TEXT),
        (&keys, Type::TEXT_ARRAY),
        (&per_key, Type::INT8),
    ];
    let rows = client
        .client()
        .query_typed(sql::KEY_WAITING, &params)
        .await?;
    rows.iter()
        .map(|r| {
            Ok(WaitingDelivery {
                key: r.try_get("key")?,
                event_seq: r.try_get("event_seq")?,
                event_id: r.try_get("event_id")?,
                event_name: r.try_get("event_name")?,
                available_at: r.try_get("available_at")?,
            })
        })
        .collect()
}

/// Makes a key's head due now: a dead head goes back to pending with its attempts reset
/// (its failure history is kept); a head backing off after a failure is retried at once.
/// Returns whether the key had such a head.
///
/// # Errors
///
/// [`Error::NeedsGrant`](crate::Error::NeedsGrant) when the role lacks the operator grant
/// (`pgbus.grant_operator`; nothing is changed), [`Error::Database`](crate::Error::Database)
/// when the statement fails.
pub async fn redrive_head<C: Executor + ?Sized>(
    client: &C,
    subscription: &str,
    key: &str,
) -> Result<bool> {
    let params: [(&(dyn ToSql + Sync), Type); 2] =
        [(&subscription, Type::TEXT), (&key, Type::TEXT)];
    let rows = client
        .client()
        .query_typed(sql::REDRIVE_HEAD, &params)
        .await
        .map_err(crate::Error::from);
    let rows = needs_grant(client, "redriving a key's head", Grant::Operator, rows).await?;
    let redriven = match rows.first() {
        Some(row) => row.try_get::<_, i64>("redriven")?,
        None => 0,
    };
    Ok(redriven > 0)
}

/// Skips a key's dead head: it stays a dead letter (listed, replayable), and the key's
/// next delivery becomes the head. Returns whether there was a dead head to skip.
///
/// # Errors
///
/// [`Error::NeedsGrant`](crate::Error::NeedsGrant) when the role lacks the operator grant
/// (`pgbus.grant_operator`; nothing is changed), [`Error::Database`](crate::Error::Database)
/// when the statement fails.
pub async fn skip_head<C: Executor + ?Sized>(
    client: &C,
    subscription: &str,
    key: &str,
) -> Result<bool> {
    let params: [(&(dyn ToSql + Sync), Type); 2] =
        [(&subscription, Type::TEXT), (&key, Type::TEXT)];
    let rows = client
        .client()
        .query_typed(sql::SKIP_HEAD, &params)
        .await
        .map_err(crate::Error::from);
    let rows = needs_grant(client, "skipping a key's dead head", Grant::Operator, rows).await?;
    Ok(!rows.is_empty())
}

/// What [`skip_seen_head`] or [`redrive_seen_head`] found: the action done, or the key's
/// head no longer what the caller saw.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
#[non_exhaustive]
pub enum SeenHead {
    /// The key's head was the event seen, in a state the action applies to, and the
    /// action was done.
    Done {
        /// The event id of the key's next delivery, made its head by a skip (`None`: a
        /// redrive, or nothing waited behind the skipped head).
        promoted: Option<String>,
    },
    /// Nothing was done: the key's head is not (or no longer) the event seen, or it is
    /// but not in a state the action applies to (a skip needs it dead; a redrive, dead
    /// or pending).
    Changed {
        /// The event id of the key's head now (`None`: the key has no head).
        head: Option<String>,
        /// Its state: `pending`, `processing` or `dead`.
        status: Option<String>,
    },
}

/// Runs one of the `seen` head statements (`$1` subscription, `$2` key, `$3` the head's
/// event id as seen) and returns its row.
async fn on_seen_head<C: Executor + ?Sized>(
    client: &C,
    statement: &str,
    action: &'static str,
    [subscription, key, event_id]: [&str; 3],
) -> Result<tokio_postgres::Row> {
    let params: [(&(dyn ToSql + Sync), Type); 3] = [
        (&subscription, Type::TEXT),
        (&key, Type::TEXT),
        (&event_id, Type::TEXT),
    ];
    let rows = client
        .client()
        .query_typed(statement, &params)
        .await
        .map_err(crate::Error::from);
    let mut rows = needs_grant(client, action, Grant::Operator, rows).await?;
    rows.pop()
        .ok_or(crate::Error::Unexpected("a head statement returned no row"))
}

/// The [`SeenHead::Changed`] of a `seen` head statement's row.
fn changed(row: &tokio_postgres::Row) -> Result<SeenHead> {
    Ok(SeenHead::Changed {
        head: row.try_get("head")?,
        status: row.try_get("head_status")?,
    })
}

impl SeenHead {
    /// For [`SeenHead::Changed`], how the key's head differs from `seen` (the event the
    /// caller saw), in words: "its head is now E2 (pending), not E1", "its head E1 is
    /// pending now", or "it has no head now". `None` when the action was done.
    pub fn change_from(&self, seen: &str) -> Option<String> {
        let SeenHead::Changed { head, status } = self else {
            return None;
        };
        Some(match (head, status) {
            (Some(head), Some(status)) if head == seen => {
                format!("its head {head} is {status} now")
            }
            (Some(head), Some(status)) => format!("its head is now {head} ({status}), not {seen}"),
            _ => "it has no head now".to_owned(),
        })
    }
}

/// [`skip_head`], bound to the head the caller saw: skips the key's dead head only if it
/// is the event `event_id`, and otherwise changes nothing and says what the head is now.
/// A form sent again, or from a page loaded before someone else acted on the key, so
/// never skips a head its operator did not see.
///
/// # Errors
///
/// As [`skip_head`].
pub async fn skip_seen_head<C: Executor + ?Sized>(
    client: &C,
    subscription: &str,
    key: &str,
    event_id: &str,
) -> Result<SeenHead> {
    let row = on_seen_head(
        client,
        sql::SKIP_SEEN_HEAD,
        "skipping a key's dead head",
        [subscription, key, event_id],
    )
    .await?;
    match row.try_get::<_, Option<String>>("skipped")? {
        Some(_) => Ok(SeenHead::Done {
            promoted: row.try_get("promoted")?,
        }),
        None => changed(&row),
    }
}

/// [`redrive_head`], bound to the head the caller saw: redrives the key's head only if
/// it is the event `event_id` and dead or pending, and otherwise changes nothing and says
/// what the head is now.
///
/// # Errors
///
/// As [`redrive_head`].
pub async fn redrive_seen_head<C: Executor + ?Sized>(
    client: &C,
    subscription: &str,
    key: &str,
    event_id: &str,
) -> Result<SeenHead> {
    let row = on_seen_head(
        client,
        sql::REDRIVE_SEEN_HEAD,
        "redriving a key's head",
        [subscription, key, event_id],
    )
    .await?;
    if row.try_get::<_, i64>("redriven")? > 0 {
        Ok(SeenHead::Done { promoted: None })
    } else {
        changed(&row)
    }
}
