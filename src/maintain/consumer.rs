//! The bus's row in `pgbus.consumers`: its heartbeat, which is also its run for the
//! maintenance leadership (`pgbus.beat`), its resignation and its removal.

use std::sync::Arc;
use std::time::Duration;

use tokio_postgres::types::{ToSql, Type};
use tokio_util::sync::CancellationToken;

use crate::conn::Db;
use crate::error::{Error, Result};
use crate::sql;

/// How often a bus renews its row and runs for leadership, given the leadership's
/// length and its own delivery lease. A leader renews three times per leadership, and
/// at least twice per delivery lease, so that it sees every lease before it runs out;
/// a follower beats every 1.25 leaderships: a leader that died without leaving is
/// replaced within a leadership and a follower's beat.
pub(crate) fn beat_interval(leads: bool, leadership: Duration, lease: Duration) -> Duration {
    if leads {
        (leadership / 3)
            .min(lease / 2)
            .max(Duration::from_millis(100))
    } else {
        leadership + leadership / 4
    }
}

/// How long a bus's row stays live without a beat: two of a follower's beats.
pub(crate) fn consumer_ttl(leadership: Duration) -> Duration {
    2 * beat_interval(false, leadership, leadership)
}

/// What one beat returned.
#[derive(Debug)]
pub(crate) struct Beat {
    /// The bus's subscriptions that no longer exist.
    pub(crate) missing: Vec<String>,
    /// Whether this bus leads the maintenance now.
    pub(crate) leads: bool,
    /// For a leader: how soon the earliest lease of any bus runs out.
    pub(crate) next_expiry: Option<Duration>,
    /// For a follower: how soon the current leadership runs out.
    pub(crate) leader_expiry: Option<Duration>,
}

/// The bus's row in `pgbus.consumers`.
#[derive(Debug, Clone)]
pub(crate) struct Consumer {
    pub(crate) db: Db,
    pub(crate) worker: Arc<str>,
    pub(crate) subscriptions: Vec<Arc<str>>,
    pub(crate) poll_only: bool,
    /// How long a leadership lasts without renewal.
    pub(crate) leadership: Duration,
}

impl Consumer {
    /// Registers or renews the row and, with `lead`, runs for (or renews) the
    /// maintenance leadership. When `stop` fires first, the statement is cancelled on the
    /// server (a beat can wait for a lock, holding the leader row) and the beat fails
    /// with [`Error::Closed`].
    pub(crate) async fn beat(&self, lead: bool, stop: &CancellationToken) -> Result<Beat> {
        let client = self.db.get().await?;
        let ttl_ms = consumer_ttl(self.leadership).as_millis() as i64;
        let lead_ms = lead.then(|| self.leadership.as_millis().max(1) as i64);
        let subs: Vec<&str> = self.subscriptions.iter().map(|s| &**s).collect();
        let info = format!(
            "pid {} on {}",
            std::process::id(),
            std::env::var("HOSTNAME").unwrap_or_else(|_| "unknown host".into())
        );
        let worker: &str = &self.worker;
        let params: [&(dyn ToSql + Sync); 6] =
            [&worker, &ttl_ms, &subs, &info, &self.poll_only, &lead_ms];
        let query = self.db.query(
            &client,
            sql::CONSUMER_BEAT,
            &[
                Type::TEXT,
                Type::INT8,
                Type::TEXT_ARRAY,
                Type::TEXT,
                Type::BOOL,
                Type::INT8,
            ],
            &params,
        );
        let rows = self
            .db
            .unless_stopped(&client, stop, query)
            .await
            .ok_or(Error::Closed)??;
        let row = rows
            .first()
            .ok_or(Error::Unexpected("the consumer beat returned no row"))?;
        let next_expiry: Option<i64> = row.try_get("next_expiry_ms")?;
        let leader_expiry: Option<i64> = row.try_get("leader_expiry_ms")?;
        Ok(Beat {
            leader_expiry: leader_expiry.map(|ms| Duration::from_millis(ms.max(0) as u64)),
            missing: row.try_get("missing")?,
            leads: row.try_get("leads")?,
            next_expiry: next_expiry.map(|ms| Duration::from_millis(ms.max(0) as u64)),
        })
    }

    /// Gives up the leadership, if this bus holds it (as its shutdown begins); cancelled
    /// on the server when `stop` fires first.
    pub(crate) async fn resign(&self, stop: &CancellationToken) -> Result<()> {
        let client = self.db.get().await?;
        let worker: &str = &self.worker;
        let params: [&(dyn ToSql + Sync); 1] = [&worker];
        let query = self
            .db
            .query(&client, sql::LEADER_RESIGN, &[Type::TEXT], &params);
        self.db
            .unless_stopped(&client, stop, query)
            .await
            .ok_or(Error::Closed)??;
        Ok(())
    }

    /// Removes the row (at shutdown).
    pub(crate) async fn remove(&self) -> Result<()> {
        let client = self.db.get().await?;
        let worker: &str = &self.worker;
        self.db
            .query(&client, sql::CONSUMER_REMOVE, &[Type::TEXT], &[&worker])
            .await?;
        Ok(())
    }
}
