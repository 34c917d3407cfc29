//! Registering, listing and dropping subscriptions; their settings are changed through
//! [`configure_subscription`](crate::admin::configure_subscription), re-exported here
//! from the module the runtime shares.

use chrono::{DateTime, Utc};
use tokio_postgres::GenericClient;
use tokio_postgres::types::Type;

use crate::error::{Error, Grant, Result};
use crate::executor::{Executor, Param, needs_grant, one_row};
use crate::sql;
use crate::subscription::validate_subscription;

/// Registers a subscription, or updates its patterns and maximum attempts. New patterns
/// apply to events published from then on; existing deliveries are left as they are.
///
/// # Errors
///
/// [`Error::Invalid`] for a bad name, no patterns, or a bad pattern (nothing is written);
/// [`Error::NeedsGrant`] unless run as the schema's owner (it skips the configuration
/// lock: operators use [`configure_subscription`](crate::admin::configure_subscription)); [`Error::Database`] when the statement
/// fails.
pub async fn register_subscription<C: Executor + ?Sized, S: AsRef<str>>(
    client: &C,
    name: &str,
    patterns: &[S],
    max_attempts: i32,
) -> Result<()> {
    validate_subscription(name, patterns)?;
    if max_attempts < 1 {
        return Err(Error::invalid(
            "max attempts",
            format!("must be at least 1, got {max_attempts}"),
        ));
    }
    let patterns: Vec<&str> = patterns.iter().map(AsRef::as_ref).collect();
    let params: [Param<'_>; 3] = [
        (&name, Type::TEXT),
        (&patterns, Type::TEXT_ARRAY),
        (&max_attempts, Type::INT4),
    ];
    let written = client
        .client()
        .query_typed(sql::REGISTER_SUBSCRIPTION, &params)
        .await
        .map_err(Error::from);
    needs_grant(client, "registering a subscription", Grant::Owner, written).await?;
    Ok(())
}

/// Fails with [`Error::UnknownSubscription`] unless a subscription of this name exists.
///
/// # Errors
///
/// [`Error::UnknownSubscription`], or [`Error::Database`] when the statement fails.
pub async fn require_subscription<C: Executor + ?Sized>(client: &C, name: &str) -> Result<()> {
    let exists: bool = one_row(
        client.client(),
        sql::SUBSCRIPTION_EXISTS,
        &[(&name, Type::TEXT)],
    )
    .await?
    .try_get("exists")?;
    if exists {
        Ok(())
    } else {
        Err(Error::UnknownSubscription {
            name: name.to_string(),
        })
    }
}

/// A registered subscription, from [`subscriptions`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct SubscriptionInfo {
    /// The name.
    pub name: String,
    /// The patterns.
    pub patterns: Vec<String>,
    /// Its maximum attempts.
    pub max_attempts: i32,
    /// When it was first registered.
    pub created_at: DateTime<Utc>,
    /// When its patterns or maximum attempts last changed.
    pub updated_at: DateTime<Utc>,
    /// Live consumers (running buses) serving it.
    pub consumers: i64,
    /// When it was paused ([`pause_subscription`]); `None` while it delivers.
    pub paused_at: Option<DateTime<Utc>>,
}

/// Lists the registered subscriptions, by name.
///
/// # Errors
///
/// [`Error::SchemaMissing`] when the database was never migrated, [`Error::Database`]
/// when the statement fails.
pub async fn subscriptions<C: Executor + ?Sized>(client: &C) -> Result<Vec<SubscriptionInfo>> {
    let rows = client
        .client()
        .query_typed(sql::SUBSCRIPTIONS_LIST, &[])
        .await?;
    rows.iter()
        .map(|row| {
            Ok(SubscriptionInfo {
                name: row.try_get("name")?,
                patterns: row.try_get("patterns")?,
                max_attempts: row.try_get("max_attempts")?,
                created_at: row.try_get("created_at")?,
                updated_at: row.try_get("updated_at")?,
                consumers: row.try_get("consumers")?,
                paused_at: row.try_get("paused_at")?,
            })
        })
        .collect()
}

/// What [`drop_subscription`] deleted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct Dropped {
    /// Deliveries deleted (pending, processing and dead).
    pub deliveries: u64,
    /// Rows of failure history deleted.
    pub failures: u64,
}

/// Drops a subscription with all its deliveries and their failure history. Its events
/// stay in the log (other subscriptions may need them; the sweep deletes them later).
///
/// Refuses while deliveries of it are processing, unless `force`: a worker holding one
/// then finds its settlement rejected. A bus still running with this subscription
/// registers it again when it restarts; stop its consumers first. A publish that commits
/// while the drop runs can still leave deliveries under the name; dropping again removes
/// them.
///
/// # Errors
///
/// [`Error::UnknownSubscription`] when nothing is known under the name,
/// [`Error::SubscriptionBusy`] when deliveries are processing and `force` is false
/// (nothing is deleted), [`Error::NeedsGrant`] unless run as the schema's owner,
/// [`Error::Database`] when the statement fails.
pub async fn drop_subscription<C: Executor + ?Sized>(
    client: &C,
    name: &str,
    force: bool,
) -> Result<Dropped> {
    let row = one_row(
        client.client(),
        sql::SUBSCRIPTION_DROP,
        &[(&name, Type::TEXT), (&force, Type::BOOL)],
    )
    .await;
    let row = needs_grant(client, "dropping a subscription", Grant::Owner, row).await?;
    if !row.try_get::<_, bool>("known")? {
        return Err(Error::UnknownSubscription {
            name: name.to_string(),
        });
    }
    if !row.try_get::<_, bool>("dropped")? {
        return Err(Error::SubscriptionBusy {
            name: name.to_string(),
            processing: row.try_get("processing")?,
        });
    }
    Ok(Dropped {
        deliveries: row.try_get::<_, i64>("deliveries")? as u64,
        failures: row.try_get::<_, i64>("failures")? as u64,
    })
}

/// What [`pause_subscription`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct Paused {
    /// Since when the subscription is paused: now, or when an earlier pause took effect.
    pub since: DateTime<Utc>,
    /// Whether it was paused already (this call changed nothing).
    pub already: bool,
}

/// Pauses a subscription: its consumers claim none of its deliveries until
/// [`resume_subscription`]. Publishing goes on, and its deliveries wait. What its
/// consumers hold at the pause is settled as usual, and an ordered key's next delivery is
/// still promoted when its head settles, so on resume every key goes on in order. Its
/// consumers stay connected; [`subscriptions`] and [`status`](crate::admin::status) show
/// it as paused, and the gauge `pgbus_subscription_paused` reads 1. Pausing a paused
/// subscription changes nothing.
///
/// # Errors
///
/// [`Error::UnknownSubscription`] when no subscription has the name (nothing is changed),
/// [`Error::NeedsGrant`] when the role lacks the operator grant (`pgbus.grant_operator`),
/// [`Error::Database`] when the statement fails.
pub async fn pause_subscription<C: Executor + ?Sized>(client: &C, name: &str) -> Result<Paused> {
    let row = one_row(
        client.client(),
        sql::PAUSE_SUBSCRIPTION,
        &[(&name, Type::TEXT)],
    )
    .await;
    let row = needs_grant(client, "pausing a subscription", Grant::Operator, row).await?;
    if !row.try_get::<_, bool>("known")? {
        return Err(Error::UnknownSubscription {
            name: name.to_string(),
        });
    }
    Ok(Paused {
        since: row.try_get("since")?,
        already: row.try_get("already")?,
    })
}

/// What [`resume_subscription`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct Resumed {
    /// When the subscription had been paused; `None` when it was not paused (this call
    /// changed nothing).
    pub paused_since: Option<DateTime<Utc>>,
}

/// Resumes a paused subscription: its consumers are notified and claim what waited at
/// once, oldest first, each ordered key from its head. Resuming a subscription that is
/// not paused changes nothing.
///
/// # Errors
///
/// [`Error::UnknownSubscription`] when no subscription has the name,
/// [`Error::NeedsGrant`] when the role lacks the operator grant (`pgbus.grant_operator`),
/// [`Error::Database`] when the statement fails.
pub async fn resume_subscription<C: Executor + ?Sized>(client: &C, name: &str) -> Result<Resumed> {
    let row = one_row(
        client.client(),
        sql::RESUME_SUBSCRIPTION,
        &[(&name, Type::TEXT)],
    )
    .await;
    let row = needs_grant(client, "resuming a subscription", Grant::Operator, row).await?;
    if !row.try_get::<_, bool>("known")? {
        return Err(Error::UnknownSubscription {
            name: name.to_string(),
        });
    }
    Ok(Resumed {
        paused_since: row.try_get("since")?,
    })
}
