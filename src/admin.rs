//! Operating the bus: subscriptions, status, dead letters, replay and the retention
//! sweep. The `pgbus` command line is a thin layer over these functions.
//!
//! Every function here is one statement (except [`sweep`], one statement per batch), so
//! each works on any [`Executor`]: given a client, the statement is its own transaction;
//! given a transaction, it joins it and commits or rolls back with it (the transactional
//! twin). Every value is sent as a parameter. The statements are documented in
//! `src/sql.rs`.
//!
//! Every statement is sent unnamed, with its parameter types (`query_typed`): one round
//! trip, and nothing is left on the server connection between statements, so these
//! functions work behind a pooler in transaction mode (PgBouncer), which hands each
//! transaction whichever server connection is free.
//!
//! ```no_run
//! # async fn example(client: &tokio_postgres::Client) -> Result<(), pgbus::Error> {
//! use pgbus::admin::{self, DeadLetterFilter};
//!
//! for sub in admin::status(client).await?.subscriptions {
//!     println!("{}: {} pending, {} dead", sub.name, sub.pending, sub.dead);
//! }
//! let retried = admin::retry_dead_letters(client, &DeadLetterFilter::all()).await?;
//! println!("{retried} dead letters back to pending");
//! # Ok(()) }
//! ```

use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio_postgres::Row;
use tokio_postgres::types::{ToSql, Type};

use crate::error::{Error, Grant, Result};
use crate::event::{validate_name, validate_pattern};
use crate::metrics::{FanOutBacklog, XminHorizon};
use crate::publish::Executor;
use crate::sql;
use tokio_postgres::GenericClient;

/// Default retention of the log: 7 days. Events older than this that no delivery refers
/// to are deleted by the sweep.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);

/// Default number of events one sweep batch deletes: 1,000.
pub const DEFAULT_SWEEP_BATCH: i32 = 1000;

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

/// A statement's parameter with its type, as `query_typed` takes it.
type Param<'a> = (&'a (dyn ToSql + Sync), Type);

/// Runs `statement` unnamed (see the module's documentation) and returns its one row.
///
/// # Errors
///
/// [`Error::Database`] when the statement fails, [`Error::Unexpected`] when it returns no
/// row.
pub(crate) async fn one_row<C: GenericClient>(
    client: &C,
    statement: &str,
    params: &[Param<'_>],
) -> Result<Row> {
    client
        .query_typed(statement, params)
        .await?
        .into_iter()
        .next()
        .ok_or(Error::Unexpected("a statement of one row returned none"))
}

/// `result`, or, when PostgreSQL refused `action` for want of privilege (SQLSTATE
/// 42501), [`Error::NeedsGrant`] naming `grant` and the refused role.
pub(crate) async fn needs_grant<C: Executor + ?Sized, T>(
    client: &C,
    action: &'static str,
    grant: Grant,
    result: Result<T>,
) -> Result<T> {
    match result {
        Err(Error::Database(source))
            if source.code() == Some(&tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE) =>
        {
            // Best effort: inside a failed transaction the role cannot be read.
            let role = match client
                .client()
                .query_typed("SELECT current_user", &[])
                .await
            {
                Ok(rows) => rows.first().and_then(|r| r.try_get::<_, String>(0).ok()),
                Err(_) => None,
            };
            Err(Error::NeedsGrant {
                action,
                grant,
                role,
                source,
            })
        }
        other => other,
    }
}

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

/// Registers a subscription, or updates its patterns and maximum attempts. New patterns
/// apply to events published from then on; existing deliveries are left as they are.
///
/// # Errors
///
/// [`Error::Invalid`] for a bad name, no patterns, or a bad pattern (nothing is written);
/// [`Error::NeedsGrant`] unless run as the schema's owner (it skips the configuration
/// lock: operators use [`configure_subscription`]); [`Error::Database`] when the statement
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
        .query_typed(
            "INSERT INTO pgbus.subscriptions AS s (name, patterns, max_attempts) \
             VALUES ($1, $2, $3) \
             ON CONFLICT (name) DO UPDATE \
             SET patterns = EXCLUDED.patterns, max_attempts = EXCLUDED.max_attempts, \
                 updated_at = now() \
             WHERE (s.patterns, s.max_attempts) \
                   IS DISTINCT FROM (EXCLUDED.patterns, EXCLUDED.max_attempts)",
            &params,
        )
        .await
        .map_err(Error::from);
    needs_grant(client, "registering a subscription", Grant::Owner, written).await?;
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

/// One subscription's state, from [`status`].
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct SubscriptionStatus {
    /// The subscription's name.
    pub name: String,
    /// Its patterns.
    pub patterns: Vec<String>,
    /// Its maximum attempts.
    pub max_attempts: i32,
    /// Deliveries waiting: due now, or retries scheduled later.
    pub pending: i64,
    /// Pending deliveries that are due now.
    pub due: i64,
    /// Deliveries claimed by a worker and not yet settled.
    pub processing: i64,
    /// Dead letters.
    pub dead: i64,
    /// Keys of an ordered subscription whose head is a dead letter (the key waits).
    pub blocked_keys: i64,
    /// How long the oldest due delivery has been due (the lag); `None` when none is due.
    pub oldest_due_age: Option<Duration>,
    /// Events published in the last minute that matched this subscription and whose
    /// delivery is finished (completed, or purged; an event not yet turned into deliveries
    /// is not). Completed deliveries are deleted, so this is read from the log: a retry or
    /// replay of an older event is not counted. Exact unless
    /// [`done_estimated`](Self::done_estimated).
    pub done_last_minute: i64,
    /// Whether [`done_last_minute`](Self::done_last_minute) is an estimate: the last
    /// minute held more than [`RECENT_EVENTS_CAP`] events, or more than
    /// [`RECENT_PROBES_CAP`] pairs of an event and a matching subscription, and the count
    /// was taken over an even sample of it and scaled up (shown as `~N`).
    pub done_estimated: bool,
    /// Live consumers (running buses) serving this subscription.
    pub consumers: i64,
}

/// The bus's state, from [`status`].
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct Status {
    /// Every subscription, by name.
    pub subscriptions: Vec<SubscriptionStatus>,
    /// How full PostgreSQL's notification queue is, from 0 to 1
    /// (`pg_notification_queue_usage()`); near 1, a listener has stopped reading.
    pub notification_queue_usage: f64,
    /// Backends of this database named `pgbus listener` in `pg_stat_activity`.
    pub listeners: i64,
    /// Live consumers (running buses) in `pgbus.consumers`.
    pub consumers: i64,
    /// Live consumers that are asleep (publishers notify them).
    pub sleeping_consumers: i64,
    /// What holds the database's xmin horizon back: the oldest transaction, and the
    /// replication slots (see [`xmin_horizon`]).
    pub horizon: XminHorizon,
    /// The events committed and not yet turned into deliveries (see
    /// [`fan_out_backlog`]): none of the subscriptions' counts include them yet.
    pub fan_out: FanOutBacklog,
}

/// The most events of the last minute [`status`] reads to count each subscription's
/// [`done_last_minute`](SubscriptionStatus::done_last_minute): a busier minute is
/// sampled evenly and the counts are estimated.
pub const RECENT_EVENTS_CAP: i64 = 2_000;

/// The most deliveries [`status`] probes (one per event and matching subscription) to
/// count [`done_last_minute`](SubscriptionStatus::done_last_minute), and
/// [`delivered_recently`] per event it may read: beyond, the sample is thinned and the
/// counts are estimated.
pub const RECENT_PROBES_CAP: i64 = 10_000;

/// Reads the state of every subscription and of the notification machinery.
///
/// Counting the backlog reads every delivery (O(backlog)); it is meant for operators,
/// not for a hot path. The last minute's counts cost at most [`RECENT_EVENTS_CAP`]
/// events and [`RECENT_PROBES_CAP`] probes, whatever the traffic
/// ([`SubscriptionStatus::done_estimated`]).
///
/// # Errors
///
/// [`Error::SchemaMissing`] when the database was never migrated, [`Error::Database`]
/// when a statement fails.
pub async fn status<C: Executor + ?Sized>(client: &C) -> Result<Status> {
    status_of(client, None).await
}

/// [`status`] with only one subscription's row (`Some(name)`), computed for that one
/// alone; `None`: every subscription.
///
/// # Errors
///
/// [`Error::UnknownSubscription`] when there is no subscription of that name; otherwise
/// as [`status`].
pub async fn status_of<C: Executor + ?Sized>(
    client: &C,
    subscription: Option<&str>,
) -> Result<Status> {
    let client = client.client();
    let subscriptions = subscription_statuses(client, subscription).await?;
    if let (Some(name), true) = (subscription, subscriptions.is_empty()) {
        return Err(Error::UnknownSubscription {
            name: name.to_string(),
        });
    }
    let cluster = read_cluster(client).await?;
    Ok(Status {
        subscriptions,
        notification_queue_usage: cluster.notification_queue_usage,
        listeners: cluster.listeners,
        consumers: cluster.consumers,
        sleeping_consumers: cluster.sleeping_consumers,
        horizon: cluster.horizon,
        fan_out: cluster.fan_out,
    })
}

/// Samples the backlog gauges of `subscriptions` (`None`: every registered
/// subscription), one [`Backlog`](crate::metrics::Backlog) per subscription, by name:
/// one index-backed statement whose counts stop at
/// [`GAUGE_COUNT_CAP`](crate::metrics::GAUGE_COUNT_CAP), so it stays cheap at any
/// backlog (unlike [`status`]). [`Backlog::record`](crate::metrics::Backlog::record)
/// sets the gauges; a running bus samples its own subscriptions by itself.
///
/// # Errors
///
/// [`Error::Database`] when the statement fails.
pub async fn backlog<C: Executor + ?Sized>(
    client: &C,
    subscriptions: Option<&[&str]>,
) -> Result<Vec<crate::metrics::Backlog>> {
    let cap = crate::metrics::GAUGE_COUNT_CAP;
    let params: [Param<'_>; 2] = [
        (&subscriptions, sql::BACKLOG_TYPES[0].clone()),
        (&cap, sql::BACKLOG_TYPES[1].clone()),
    ];
    let rows = client.client().query_typed(sql::BACKLOG, &params).await?;
    rows.iter().map(crate::metrics::Backlog::from_row).collect()
}

/// The state of one subscription (see [`status`]).
///
/// # Errors
///
/// [`Error::UnknownSubscription`] when there is none of this name; otherwise as
/// [`status`].
pub async fn subscription_status<C: Executor + ?Sized>(
    client: &C,
    name: &str,
) -> Result<SubscriptionStatus> {
    subscription_statuses(client.client(), Some(name))
        .await?
        .pop()
        .ok_or_else(|| Error::UnknownSubscription {
            name: name.to_string(),
        })
}

async fn subscription_statuses<C: GenericClient>(
    client: &C,
    name: Option<&str>,
) -> Result<Vec<SubscriptionStatus>> {
    let [t_name, t_events, t_probes] = sql::STATUS_SUBSCRIPTIONS_TYPES;
    let rows = client
        .query_typed(
            sql::STATUS_SUBSCRIPTIONS,
            &[
                (&name, t_name),
                (&RECENT_EVENTS_CAP, t_events),
                (&RECENT_PROBES_CAP, t_probes),
            ],
        )
        .await?;
    rows.iter()
        .map(|row| {
            Ok(SubscriptionStatus {
                name: row.try_get("name")?,
                patterns: row.try_get("patterns")?,
                max_attempts: row.try_get("max_attempts")?,
                pending: row.try_get("pending")?,
                due: row.try_get("due")?,
                processing: row.try_get("processing")?,
                dead: row.try_get("dead")?,
                blocked_keys: row.try_get("blocked_keys")?,
                // An infinite age (a row written with available_at = -infinity before
                // the schema refused it) reads as the longest duration there is.
                oldest_due_age: row
                    .try_get::<_, Option<f64>>("oldest_due_age")?
                    .map(|s| Duration::try_from_secs_f64(s.max(0.0)).unwrap_or(Duration::MAX)),
                done_last_minute: row.try_get("done_last_minute")?,
                done_estimated: row.try_get("done_estimated")?,
                consumers: row.try_get("consumers")?,
            })
        })
        .collect()
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

// ---- The dashboard's reads (`pgbus ui`) ----

/// A live consumer (a running bus), from [`consumers`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct ConsumerInfo {
    /// The bus's worker id.
    pub id: String,
    /// Whether it is awake (claiming without being notified); asleep, publishers notify
    /// it.
    pub awake: bool,
    /// The subscriptions it serves.
    pub subscriptions: Vec<String>,
    /// When it started.
    pub started_at: DateTime<Utc>,
    /// Its last heartbeat: when it last renewed its row.
    pub last_heartbeat: DateTime<Utc>,
    /// When its row stops counting as live unless it beats again.
    pub expires_at: DateTime<Utc>,
    /// What the bus says of its process: `pid N on HOST`.
    pub info: Option<String>,
}

/// Lists the live consumers (running buses), by id.
///
/// # Errors
///
/// [`Error::Database`] when the statement fails.
pub async fn consumers<C: Executor + ?Sized>(client: &C) -> Result<Vec<ConsumerInfo>> {
    let rows = client
        .client()
        .query_typed(sql::CONSUMERS_LIST, &[])
        .await?;
    rows.iter()
        .map(|row| {
            Ok(ConsumerInfo {
                id: row.try_get("id")?,
                awake: row.try_get("awake")?,
                subscriptions: row.try_get("subscriptions")?,
                started_at: row.try_get("started_at")?,
                last_heartbeat: row.try_get("beat_at")?,
                expires_at: row.try_get("expires_at")?,
                info: row.try_get("info")?,
            })
        })
        .collect()
}

/// What [`delivered_recently`] counted.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct RecentlyDelivered {
    /// Events finished per subscription, by name; a subscription that finished none is
    /// absent.
    pub delivered: Vec<(String, i64)>,
    /// The window held more events than the most read (or more pairs of an event and a
    /// matching subscription than the probes allowed): the counts are estimated from an
    /// even sample of the window, its newest event included, scaled up (shown as `~N`).
    pub capped: bool,
}

/// How many events of the last `window` each subscription has finished (completed, or
/// purged), reading at most `max_events` events of the window and probing the
/// deliveries at most `max_events` times (once per event and matching subscription).
/// Divided by the window, it is the subscription's recent throughput (an estimate when
/// [`capped`](RecentlyDelivered::capped)). Read from the log, as
/// [`SubscriptionStatus::done_last_minute`]: its cost is bounded by `max_events`,
/// whatever the backlog, the publishing rate or how many subscriptions an event matches.
///
/// # Errors
///
/// [`Error::Invalid`] for a zero window or `max_events` below 1, [`Error::Database`]
/// when the statement fails.
pub async fn delivered_recently<C: Executor + ?Sized>(
    client: &C,
    window: Duration,
    max_events: i64,
) -> Result<RecentlyDelivered> {
    if window.is_zero() {
        return Err(Error::invalid("window", "must be positive"));
    }
    if max_events < 1 {
        return Err(Error::invalid("max events", "must be at least 1"));
    }
    let seconds = window.as_secs_f64();
    let rows = client
        .client()
        .query_typed(
            sql::DELIVERED_RECENTLY,
            &[
                (&seconds, Type::FLOAT8),
                (&max_events, Type::INT8),
                (&max_events, Type::INT8),
            ],
        )
        .await?;
    let mut out = RecentlyDelivered::default();
    for row in &rows {
        out.capped |= row.try_get::<_, bool>("estimated")?;
        if let Some(subscription) = row.try_get::<_, Option<String>>("subscription")? {
            out.delivered
                .push((subscription, row.try_get("delivered")?));
        }
    }
    Ok(out)
}

/// One failed attempt of a delivery, from [`failure_history`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct FailedAttempt {
    /// The event's position in the log.
    pub event_seq: i64,
    /// The attempt's number (counted since the delivery was last retried by an
    /// operator, who resets the attempts).
    pub attempt: i32,
    /// Its error.
    pub error: String,
    /// The worker that made it (`None` for a lease that expired).
    pub worker: Option<String>,
    /// When it failed.
    pub failed_at: DateTime<Utc>,
}

/// The failure history of `subscription`'s deliveries of the events `event_seqs`: every
/// failed attempt, by event and then oldest first, at most `limit` rows in all.
///
/// # Errors
///
/// [`Error::Database`] when the statement fails.
pub async fn failure_history<C: Executor + ?Sized>(
    client: &C,
    subscription: &str,
    event_seqs: &[i64],
    limit: i64,
) -> Result<Vec<FailedAttempt>> {
    let rows = client
        .client()
        .query_typed(
            sql::FAILURE_HISTORY,
            &[
                (&subscription, Type::TEXT),
                (&event_seqs, Type::INT8_ARRAY),
                (&limit, Type::INT8),
            ],
        )
        .await?;
    rows.iter()
        .map(|row| {
            Ok(FailedAttempt {
                event_seq: row.try_get("event_seq")?,
                attempt: row.try_get("attempt")?,
                error: row.try_get("error")?,
                worker: row.try_get("worker")?,
                failed_at: row.try_get("failed_at")?,
            })
        })
        .collect()
}

/// The event whose id is `id`; when there is none, the events whose correlation id is
/// `id`, oldest first, at most `limit`. An event whose columns cannot be read back (see
/// the claim's decoding) comes back with its name and id, and a payload saying why.
///
/// The search by id is a probe of the log's unique index; the one by correlation id
/// reads the whole log (it has no index on that column).
///
/// # Errors
///
/// [`Error::Database`] when a statement fails.
pub async fn find_events<C: Executor + ?Sized>(
    client: &C,
    id: &str,
    limit: i64,
) -> Result<Vec<crate::Event>> {
    let client = client.client();
    let mut rows = client
        .query_typed(sql::EVENT_BY_ID, &[(&id, Type::TEXT)])
        .await?;
    if rows.is_empty() {
        rows = client
            .query_typed(
                sql::EVENTS_BY_CORRELATION,
                &[(&id, Type::TEXT), (&limit, Type::INT8)],
            )
            .await?;
    }
    rows.iter()
        .map(|row| {
            let seq: i64 = row.try_get("seq")?;
            Ok(match crate::decode::event(row, seq) {
                Ok((event, _)) => event,
                Err(e) => {
                    let mut event = crate::decode::placeholder(row, seq);
                    event.payload = serde_json::Value::String(format!("undecodable: {e}"));
                    event
                }
            })
        })
        .collect()
}

/// Where an event's delivery stands in one subscription, from [`event_deliveries`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct EventDelivery {
    /// The subscription.
    pub subscription: String,
    /// `pending`, `processing`, `dead`, or `done` (completed, or purged: no delivery is
    /// left of an event the subscription matches).
    pub status: String,
    /// Attempts made (`None` when done).
    pub attempts: Option<i32>,
    /// When a pending delivery is (or was) due.
    pub available_at: Option<DateTime<Utc>>,
    /// The worker holding a processing delivery.
    pub locked_by: Option<String>,
    /// The last attempt's error.
    pub last_error: Option<String>,
    /// The ordering key, in an ordered subscription.
    pub ordering_key: Option<String>,
    /// Whether it is its key's head (every delivery of an unordered subscription is).
    pub is_head: Option<bool>,
}

/// Where the delivery of the event at `event_seq` stands in every subscription that has
/// a delivery of it or matches it, by subscription name.
///
/// # Errors
///
/// [`Error::Database`] when the statement fails.
pub async fn event_deliveries<C: Executor + ?Sized>(
    client: &C,
    event_seq: i64,
) -> Result<Vec<EventDelivery>> {
    let rows = client
        .client()
        .query_typed(sql::EVENT_DELIVERIES, &[(&event_seq, Type::INT8)])
        .await?;
    rows.iter()
        .map(|row| {
            Ok(EventDelivery {
                subscription: row.try_get("subscription")?,
                status: row.try_get("status")?,
                attempts: row.try_get("attempts")?,
                available_at: row.try_get("available_at")?,
                locked_by: row.try_get("locked_by")?,
                last_error: row.try_get("last_error")?,
                ordering_key: row.try_get("ordering_key")?,
                is_head: row.try_get("is_head")?,
            })
        })
        .collect()
}

/// The notification machinery's state, from [`cluster_status`]: [`Status`] without the
/// subscriptions.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct ClusterStatus {
    /// How full PostgreSQL's notification queue is, from 0 to 1.
    pub notification_queue_usage: f64,
    /// Backends of this database named `pgbus listener` in `pg_stat_activity`.
    pub listeners: i64,
    /// Live consumers (running buses).
    pub consumers: i64,
    /// Live consumers that are asleep.
    pub sleeping_consumers: i64,
    /// What holds the database's xmin horizon back (see [`xmin_horizon`]).
    pub horizon: XminHorizon,
    /// The events not yet turned into deliveries (see [`fan_out_backlog`]).
    pub fan_out: FanOutBacklog,
}

/// Reads the notification machinery's state and the xmin horizon alone: two cheap
/// statements, unlike [`status`], which also counts every delivery.
///
/// # Errors
///
/// [`Error::Database`] when the statement fails.
pub async fn cluster_status<C: Executor + ?Sized>(client: &C) -> Result<ClusterStatus> {
    read_cluster(client.client()).await
}

async fn read_cluster<C: GenericClient>(client: &C) -> Result<ClusterStatus> {
    let row = one_row(client, sql::STATUS_CLUSTER, &[]).await?;
    let horizon = one_row(client, sql::XMIN_HORIZON, &[]).await?;
    let fan_out = read_fan_out_backlog(client).await?;
    Ok(ClusterStatus {
        notification_queue_usage: row.try_get("notification_queue_usage")?,
        listeners: row.try_get("listeners")?,
        consumers: row.try_get("consumers")?,
        sleeping_consumers: row.try_get("sleeping_consumers")?,
        horizon: XminHorizon::from_row(&horizon)?,
        fan_out,
    })
}

/// Counts the events committed and not yet turned into deliveries, up to
/// [`GAUGE_COUNT_CAP`](crate::metrics::GAUGE_COUNT_CAP), with the age of the oldest: the
/// first stage of the backlog (docs/ARCHITECTURE.md, "The log-first publish"). A
/// running bus turns them into deliveries at its next claim, so the count stays near 0
/// while one runs. [`FanOutBacklog::record`] sets its gauges.
///
/// # Errors
///
/// [`Error::Database`] when the statement fails.
pub async fn fan_out_backlog<C: Executor + ?Sized>(client: &C) -> Result<FanOutBacklog> {
    read_fan_out_backlog(client.client()).await
}

async fn read_fan_out_backlog<C: GenericClient>(client: &C) -> Result<FanOutBacklog> {
    let cap = crate::metrics::GAUGE_COUNT_CAP;
    let params: [Param<'_>; 1] = [(&cap, sql::FAN_OUT_BACKLOG_TYPES[0].clone())];
    FanOutBacklog::from_row(&one_row(client, sql::FAN_OUT_BACKLOG, &params).await?)
}

/// Reads what holds the database's xmin horizon back: the oldest transaction of this
/// database with a snapshot or a transaction id (a session idle in transaction, a long
/// query or report, a prepared transaction), and the oldest xmin of a replication slot.
/// While one is held, VACUUM cannot remove what settled deliveries leave behind, and
/// the claims and settlements slow down as they walk past it (docs/operations.md, "A
/// long transaction"). [`XminHorizon::record`] sets its gauges.
///
/// # Errors
///
/// [`Error::Database`] when the statement fails.
pub async fn xmin_horizon<C: Executor + ?Sized>(client: &C) -> Result<XminHorizon> {
    let row = one_row(client.client(), sql::XMIN_HORIZON, &[]).await?;
    XminHorizon::from_row(&row)
}
