//! A subscription's stored settings: reading them, changing them under the
//! configuration lock, and joining a subscription as a starting bus does.
//!
//! Every consumer of a subscription follows what `pgbus.subscriptions` stores: its
//! patterns, maximum attempts, ordering and dead-head policy. A starting bus joins
//! ([`join_subscription`]): it creates the subscription with what it asks for, or follows
//! the stored settings and refuses to start where it asks for different ones. An operator
//! changes them with [`configure_subscription`], which waits for the configuration lock
//! in short tries so that publishes and settlements get through meanwhile. The runtime
//! and the operator API ([`crate::admin`]) both use this module; it uses neither.

use std::time::Duration;

use tokio_postgres::GenericClient;
use tokio_postgres::types::Type;

use crate::error::{Error, Grant, Result};
use crate::event::{validate_name, validate_pattern};
use crate::executor::{Executor, Param, needs_grant, one_row};
use crate::sql;

/// How long [`configure_subscription`] waits for the configuration lock: 30 s.
pub const DEFAULT_CONFIGURE_WAIT: Duration = Duration::from_secs(30);

/// How long one try for the configuration lock may hold up the publishes and settlements
/// that queue behind it.
const CONFIGURE_TRY: Duration = Duration::from_millis(200);

/// The pause after the first failed try for the configuration lock; it doubles up to
/// [`CONFIGURE_PAUSE_MAX`].
const CONFIGURE_PAUSE: Duration = Duration::from_millis(50);

/// The longest pause between two tries for the configuration lock.
const CONFIGURE_PAUSE_MAX: Duration = Duration::from_secs(1);

/// How often a waiting settings change repeats its warning.
const CONFIGURE_WARN_EVERY: Duration = Duration::from_secs(5);

/// Checks a subscription's name and patterns the way the schema's CHECK constraints do.
///
/// # Errors
///
/// [`Error::Invalid`] naming the first problem.
pub fn validate_subscription<S: AsRef<str>>(name: &str, patterns: &[S]) -> Result<()> {
    validate_name("subscription name", name)?;
    if patterns.is_empty() {
        return Err(Error::invalid(
            "pattern",
            format!("subscription {name:?} needs at least one pattern"),
        ));
    }
    for p in patterns {
        validate_pattern(p.as_ref())?;
    }
    Ok(())
}

/// What an ordered subscription does when the head of a key becomes a dead letter (see
/// [`crate::ordering`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum DeadHeadPolicy {
    /// The key stops until an operator redrives or skips its dead head; every other key
    /// flows (default).
    #[default]
    Block,
    /// The dead head is set aside (still listed as a dead letter) and the key's next
    /// delivery is promoted.
    Skip,
}

impl DeadHeadPolicy {
    pub(crate) fn as_sql(self) -> &'static str {
        match self {
            DeadHeadPolicy::Block => "block",
            DeadHeadPolicy::Skip => "skip",
        }
    }

    pub(crate) fn from_sql(value: &str) -> Self {
        match value {
            "skip" => DeadHeadPolicy::Skip,
            _ => DeadHeadPolicy::Block,
        }
    }
}

/// A subscription's settings as stored in `pgbus.subscriptions`: what every consumer of
/// it follows.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct SubscriptionSettings {
    /// Event-name patterns (`order.placed`, `order.*`, `*`).
    pub patterns: Vec<String>,
    /// Attempts before a delivery becomes a dead letter.
    pub max_attempts: i32,
    /// Whether each ordering key is delivered one event at a time, in commit order.
    pub ordered: bool,
    /// What an ordered subscription does with a key whose head is dead.
    pub on_dead: DeadHeadPolicy,
}

/// A change of a subscription's settings: each `None` keeps the stored value. Used by
/// [`configure_subscription`], and by a starting bus to say what it asks for.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SubscriptionChange {
    /// New patterns (applied to events published from then on).
    pub patterns: Option<Vec<String>>,
    /// New maximum attempts (at least 1).
    pub max_attempts: Option<i32>,
    /// Ordering on or off; the backlog is converted in the same transaction.
    pub ordered: Option<bool>,
    /// The dead-head policy of an ordered subscription.
    pub on_dead: Option<DeadHeadPolicy>,
}

impl SubscriptionChange {
    /// No change.
    pub fn new() -> Self {
        SubscriptionChange::default()
    }

    /// Sets the patterns.
    pub fn patterns<I, S>(mut self, patterns: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.patterns = Some(patterns.into_iter().map(Into::into).collect());
        self
    }

    /// Sets the maximum attempts.
    pub fn max_attempts(mut self, attempts: i32) -> Self {
        self.max_attempts = Some(attempts);
        self
    }

    /// Turns ordering on or off.
    pub fn ordered(mut self, ordered: bool) -> Self {
        self.ordered = Some(ordered);
        self
    }

    /// Sets the dead-head policy.
    pub fn on_dead(mut self, policy: DeadHeadPolicy) -> Self {
        self.on_dead = Some(policy);
        self
    }

    fn validate(&self, name: &str) -> Result<()> {
        validate_name("subscription name", name)?;
        if let Some(patterns) = &self.patterns {
            validate_subscription(name, patterns)?;
        }
        if let Some(n) = self.max_attempts
            && n < 1
        {
            return Err(Error::invalid(
                "max attempts",
                format!("must be at least 1, got {n}"),
            ));
        }
        Ok(())
    }

    /// The settings this change asks for that differ from `stored`, in words.
    fn differences(&self, stored: &SubscriptionSettings) -> Vec<String> {
        let mut out = Vec::new();
        if let Some(p) = &self.patterns
            && *p != stored.patterns
        {
            out.push(format!(
                "patterns {} (stored: {})",
                p.join(","),
                stored.patterns.join(",")
            ));
        }
        if let Some(n) = self.max_attempts
            && n != stored.max_attempts
        {
            out.push(format!(
                "max attempts {n} (stored: {})",
                stored.max_attempts
            ));
        }
        if let Some(o) = self.ordered
            && o != stored.ordered
        {
            out.push(format!("ordered {o} (stored: {})", stored.ordered));
        }
        if let Some(d) = self.on_dead
            && d != stored.on_dead
        {
            out.push(format!(
                "on-dead {} (stored: {})",
                d.as_sql(),
                stored.on_dead.as_sql()
            ));
        }
        out
    }

    /// The `pgbus subscriptions set` arguments that would make this change.
    fn as_command(&self, name: &str) -> String {
        let mut cmd = format!("pgbus subscriptions set {name}");
        if let Some(p) = &self.patterns {
            for p in p {
                cmd.push_str(&format!(" --pattern '{p}'"));
            }
        }
        if let Some(n) = self.max_attempts {
            cmd.push_str(&format!(" --max-attempts {n}"));
        }
        match self.ordered {
            Some(true) => cmd.push_str(" --ordered"),
            Some(false) => cmd.push_str(" --unordered"),
            None => {}
        }
        if let Some(d) = self.on_dead {
            cmd.push_str(&format!(" --on-dead {}", d.as_sql()));
        }
        cmd
    }
}

/// A subscription's stored settings, or `None` when it does not exist.
///
/// # Errors
///
/// [`Error::Database`] when the query fails.
pub async fn subscription_settings<C: Executor + ?Sized>(
    client: &C,
    name: &str,
) -> Result<Option<SubscriptionSettings>> {
    let params: [Param<'_>; 1] = [(&name, Type::TEXT)];
    let rows = client
        .client()
        .query_typed(sql::SUBSCRIPTION_SETTINGS, &params)
        .await?;
    let Some(row) = rows.first() else {
        return Ok(None);
    };
    let on_dead: &str = row.try_get("on_dead")?;
    Ok(Some(SubscriptionSettings {
        patterns: row.try_get("patterns")?,
        max_attempts: row.try_get("max_attempts")?,
        ordered: row.try_get("ordered")?,
        on_dead: DeadHeadPolicy::from_sql(on_dead),
    }))
}

/// Changes a subscription's settings, an operator action that is safe while publishers,
/// consumers and reapers run: it waits (at most [`DEFAULT_CONFIGURE_WAIT`]; see
/// [`configure_subscription_within`]) for every publish and settlement that read the old
/// settings, and converts the backlog in the same transaction. Turning ordering on gives
/// each key one head, its oldest waiting delivery (deliveries already processing finish,
/// or are retried, unordered; dead letters stay aside until retried); turning it off makes every
/// delivery claimable at once. New patterns apply to events published from then on.
/// Returns how many deliveries were converted, or `None` when there is no such
/// subscription.
///
/// # Errors
///
/// [`Error::Invalid`] for a bad name, pattern or maximum (nothing is changed);
/// [`Error::LockWait`] when other transactions held the configuration lock for the whole
/// wait (nothing is changed); [`Error::NeedsGrant`] when the role lacks the operator grant
/// (`pgbus.grant_operator`; nothing is changed); [`Error::Database`] when the statement
/// fails, e.g. inside a transaction that is not READ COMMITTED.
pub async fn configure_subscription<C: Executor + ?Sized>(
    client: &C,
    name: &str,
    change: &SubscriptionChange,
) -> Result<Option<u64>> {
    configure_subscription_within(client, name, change, DEFAULT_CONFIGURE_WAIT).await
}

/// [`configure_subscription`], waiting at most `wait` for the configuration lock.
///
/// The change needs the lock exclusively, so it waits for every transaction that read
/// the old settings, a publisher's until its commit. A request for it that simply waited
/// would queue every later publish and settlement behind it for as long as the oldest of
/// those transactions stays open; so the change tries the lock for at most 200 ms at a
/// time and pauses between tries (50 ms, doubling up to 1 s), and publishes and
/// settlements get through in between. While it waits it warns (`tracing`, every 5 s)
/// naming the sessions it waits on; after `wait` it gives up with [`Error::LockWait`]
/// naming them. It always tries at least once. Given a transaction, a failed try leaves
/// nothing behind in it.
///
/// # Errors
///
/// As [`configure_subscription`].
pub async fn configure_subscription_within<C: Executor + ?Sized>(
    client: &C,
    name: &str,
    change: &SubscriptionChange,
    wait: Duration,
) -> Result<Option<u64>> {
    change.validate(name)?;
    let on_dead = change.on_dead.map(DeadHeadPolicy::as_sql);
    let started = tokio::time::Instant::now();
    let deadline = started + wait;
    let mut pause = CONFIGURE_PAUSE;
    let mut warned: Option<tokio::time::Instant> = None;
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let try_ms = left.min(CONFIGURE_TRY).as_millis().max(1) as i32;
        let params: [Param<'_>; 6] = [
            (&name, Type::TEXT),
            (&change.patterns, Type::TEXT_ARRAY),
            (&change.max_attempts, Type::INT4),
            (&change.ordered, Type::BOOL),
            (&on_dead, Type::TEXT),
            (&try_ms, Type::INT4),
        ];
        let row = one_row(client.client(), sql::TRY_CONFIGURE_SUBSCRIPTION, &params).await;
        let row = needs_grant(
            client,
            "changing a subscription's settings",
            Grant::Operator,
            row,
        )
        .await?;
        if row.try_get::<_, bool>("got")? {
            if !row.try_get::<_, Option<bool>>("found")?.unwrap_or(false) {
                return Ok(None);
            }
            return Ok(Some(row.try_get::<_, i64>("converted")? as u64));
        }
        let sessions = lock_holders(row.try_get::<_, Option<serde_json::Value>>("waiting_on")?);
        let now = tokio::time::Instant::now();
        if now >= deadline {
            return Err(Error::LockWait {
                what: "the configuration lock",
                waited: now - started,
                sessions,
            });
        }
        if warned.is_none_or(|at| now - at >= CONFIGURE_WARN_EVERY) {
            warned = Some(now);
            let list: Vec<String> = sessions.iter().map(ToString::to_string).collect();
            tracing::warn!(
                messaging.destination.subscription.name = name,
                waited_ms = (now - started).as_millis() as i64,
                sessions = %list.join("; "),
                "pgbus is waiting for open transactions to end before it changes a subscription's settings"
            );
        }
        tokio::time::sleep(pause.min(deadline - now)).await;
        pause = (pause * 2).min(CONFIGURE_PAUSE_MAX);
    }
}

/// The sessions `pgbus.try_lock_config` names (a JSON array).
fn lock_holders(value: Option<serde_json::Value>) -> Vec<crate::LockHolder> {
    let Some(serde_json::Value::Array(items)) = value else {
        return Vec::new();
    };
    items
        .iter()
        .map(|h| crate::LockHolder {
            pid: h["pid"].as_i64().and_then(|p| i32::try_from(p).ok()),
            role: h["role"].as_str().map(str::to_owned),
            application_name: h["application_name"].as_str().map(str::to_owned),
            transaction_age: h["xact_age_ms"]
                .as_i64()
                .and_then(|ms| u64::try_from(ms).ok())
                .map(Duration::from_millis),
            waiting: h["waiting"].as_bool().unwrap_or(false),
        })
        .collect()
}

/// What a starting bus does with a subscription: creates it with what it asks for (and
/// the defaults for the rest) when it does not exist; otherwise follows the stored
/// settings, and refuses to start where it explicitly asks for different ones, unless
/// `reconfigure`, which changes them with [`configure_subscription`]. Returns the
/// settings in force.
pub(crate) async fn join_subscription<C: Executor + ?Sized>(
    client: &C,
    name: &str,
    asked: &SubscriptionChange,
    reconfigure: bool,
) -> Result<SubscriptionSettings> {
    asked.validate(name)?;
    loop {
        if let Some(stored) = subscription_settings(client, name).await? {
            let differences = asked.differences(&stored);
            if differences.is_empty() {
                return Ok(stored);
            }
            if !reconfigure {
                return Err(Error::invalid(
                    "subscription settings",
                    format!(
                        "subscription {name:?} is stored with other settings than this consumer asks for: {}; \
                         change them with `{}` (every consumer follows), or start this one with \
                         --reconfigure (BusBuilder::reconfigure(true)); a consumer that does not set \
                         them follows the stored ones",
                        differences.join(", "),
                        asked.as_command(name),
                    ),
                ));
            }
            crate::warn_limited!(
                messaging.destination.subscription.name = name,
                changes = %differences.join(", "),
                "pgbus is reconfiguring a subscription for every consumer"
            );
            configure_subscription(client, name, asked).await?;
            continue;
        }
        let Some(patterns) = &asked.patterns else {
            return Err(Error::invalid(
                "subscription",
                format!("{name:?} does not exist: give its patterns to create it"),
            ));
        };
        let max_attempts = asked.max_attempts.unwrap_or(crate::DEFAULT_MAX_ATTEMPTS);
        let ordered = asked.ordered.unwrap_or(false);
        let on_dead = asked.on_dead.unwrap_or_default().as_sql();
        let params: [Param<'_>; 5] = [
            (&name, Type::TEXT),
            (patterns, Type::TEXT_ARRAY),
            (&max_attempts, Type::INT4),
            (&ordered, Type::BOOL),
            (&on_dead, Type::TEXT),
        ];
        client
            .client()
            .query_typed(sql::SUBSCRIPTION_CREATE, &params)
            .await?;
        // Created, or created by another process meanwhile: read what is stored.
    }
}
