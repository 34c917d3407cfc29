//! The bus's connections: its own small pool for claims, settlements and maintenance, and
//! statements that a stopping bus cancels on the server rather than abandons.

use std::future::Future;
use std::time::Duration;

use std::sync::Arc;

use deadpool_postgres::{
    Hook, HookError, Manager, ManagerConfig, Object, Pool, RecyclingMethod, Runtime,
};
use futures::FutureExt;
use futures::future::BoxFuture;
use tokio::task::JoinHandle;
use tokio_postgres::Row;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::{ToSql, Type};
use tokio_util::sync::CancellationToken;

use crate::backoff::WarnGate;
use crate::connect::ConnectConfig;
use crate::error::{Error, Result};

/// The session settings of the bus's own connections.
#[derive(Debug, Clone)]
pub(crate) struct Session {
    pub(crate) pool_size: usize,
    pub(crate) statement_timeout: Duration,
    pub(crate) synchronous_commit: bool,
}

impl Session {
    /// The settings as `SET` commands: `scope` is `""` for the session, `"LOCAL "` for
    /// the transaction. The search_path is pgbus's pinned one
    /// ([`PINNED_SEARCH_PATH`](crate::schema::PINNED_SEARCH_PATH)): the bus's own
    /// statements never find an operator or function another role planted in a schema
    /// on the connecting role's path (`public`, `"$user"`).
    fn set(&self, scope: &str) -> String {
        crate::sql::session_settings(
            scope,
            self.statement_timeout.as_millis(),
            self.synchronous_commit,
        )
    }
}

/// The bus's connections: its pool, and how its statements run on them.
///
/// No setting travels as a startup option (a transaction-mode pooler refuses them). On
/// a direct connection the settings are set once per connection, and statements are
/// prepared once per connection and cached. Behind a pooler
/// ([`ConnectConfig::is_pooler`]) a connection's session is not the bus's: each
/// statement runs unnamed in a transaction of its own that sets its settings locally,
/// `BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL ...`, the statement, `COMMIT`, sent
/// together in one round trip.
#[derive(Clone)]
pub(crate) struct Db {
    pool: Pool,
    connect: ConnectConfig,
    /// Behind a pooler: what opens each statement's transaction.
    begin: Option<Arc<str>>,
    /// Limits the warning that a direct bus seems to be behind a pooler.
    pooler_hint: Arc<WarnGate>,
    /// Why the pool's last connection could not be opened.
    failed: Arc<std::sync::Mutex<Option<Error>>>,
}

impl std::fmt::Debug for Db {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Db")
            .field("connect", &self.connect)
            .field("pooler", &self.begin.is_some())
            .finish_non_exhaustive()
    }
}

/// Opens the pool's connections: through the configuration's TLS connector, each
/// driven by a task, a direct one given the bus's session settings at once.
struct Opener {
    connect: ConnectConfig,
    /// On a direct connection: the session's settings.
    setup: Option<String>,
    /// Why the last connection could not be opened: the pool's interface carries only
    /// the driver's errors, so [`Db::get`] reports this one instead.
    failed: Arc<std::sync::Mutex<Option<Error>>>,
}

impl deadpool_postgres::Connect for Opener {
    fn connect(
        &self,
        pg_config: &tokio_postgres::Config,
    ) -> BoxFuture<
        '_,
        std::result::Result<(tokio_postgres::Client, JoinHandle<()>), tokio_postgres::Error>,
    > {
        let pg_config = pg_config.clone();
        async move {
            let (client, messages) = match self.connect.connect_raw(&pg_config).await {
                Ok(connected) => connected,
                Err(e) => {
                    *self.failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                    return Err(stand_in_error());
                }
            };
            let driver = tokio::spawn(crate::connect::drive(messages));
            if let Some(setup) = &self.setup {
                client.batch_execute(setup).await?;
            }
            Ok((client, driver))
        }
        .boxed()
    }
}

/// The text of the driver error that stands in, inside the pool, for a connection
/// error of pgbus's own.
const STAND_IN: &str = "pgbus_connect_failed";

/// A driver error that stands in for [`Opener`]'s own (the driver's errors cannot be
/// made outside it; this one is a configuration parse error that names [`STAND_IN`]).
fn stand_in_error() -> tokio_postgres::Error {
    match format!("{STAND_IN}=1").parse::<tokio_postgres::Config>() {
        Err(e) => e,
        Ok(_) => unreachable!("tokio_postgres refuses unknown options"),
    }
}

/// Whether `e` is [`stand_in_error`].
fn is_stand_in(e: &tokio_postgres::Error) -> bool {
    e.as_db_error().is_none() && format!("{e:?}").contains(STAND_IN)
}

/// A pool's `pre_recycle` hook that drops a connection the server closed (a restart, a
/// terminated backend) before the pool's own check would warn about it, once per pooled
/// connection, several in the same millisecond of an outage: one rate-limited warning
/// says it instead ([`warn_limited!`](crate::warn_limited)).
pub fn drop_closed() -> Hook {
    Hook::sync_fn(|client, _| {
        if client.is_closed() {
            crate::warn_limited!(
                "pgbus dropped a pooled connection the server had closed; a new one is opened \
                 when needed"
            );
            return Err(HookError::message("connection closed"));
        }
        Ok(())
    })
}

impl Db {
    /// Builds the bus's pool. No connection is opened yet.
    pub(crate) fn new(connect: &ConnectConfig, session: &Session) -> Result<Db> {
        let mut connect = connect.clone();
        connect.pg_config_mut().application_name("pgbus worker");
        let pooler = connect.is_pooler();
        // Settling, reaping and repairs decide heads from the rows the key locks
        // protect, which only a fresh snapshot per statement shows: whatever the
        // database's default, the bus's own transactions are READ COMMITTED.
        let isolation = crate::sql::READ_COMMITTED;
        let failed = Arc::default();
        let opener = Opener {
            connect: connect.clone(),
            setup: (!pooler).then(|| format!("{}; {isolation}", session.set(""))),
            failed: Arc::clone(&failed),
        };
        let manager = Manager::from_connect(
            connect.pg_config().clone(),
            opener,
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(session.pool_size)
            .runtime(Runtime::Tokio1)
            .wait_timeout(Some(Duration::from_secs(10)))
            // Opening a connection is bounded by the configuration's startup bound,
            // host by host, and fails with the error that names the host and phase.
            .create_timeout(None)
            .recycle_timeout(Some(Duration::from_secs(5)))
            .pre_recycle(drop_closed())
            .build()
            // Fails only without a runtime for its timeouts, which is set above.
            .map_err(|_| Error::Unexpected("the bus's connection pool could not be built"))?;
        let begin = pooler.then(|| {
            format!(
                "BEGIN ISOLATION LEVEL READ COMMITTED; {}",
                session.set("LOCAL ")
            )
            .into()
        });
        Ok(Db {
            pool,
            connect,
            begin,
            pooler_hint: Arc::default(),
            failed,
        })
    }

    /// Takes a connection from the pool.
    pub(crate) async fn get(&self) -> Result<Object> {
        match self.pool.get().await {
            Ok(client) => Ok(client),
            Err(deadpool_postgres::PoolError::Backend(e)) if is_stand_in(&e) => {
                let failed = self.failed.lock().unwrap_or_else(|p| p.into_inner());
                Err(failed
                    .as_ref()
                    .and_then(Error::copy_connect)
                    .unwrap_or(Error::Unexpected("a connection could not be opened")))
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Closes the pool.
    pub(crate) fn close(&self) {
        self.pool.close();
    }

    /// Runs one of the bus's statements (its parameters' types given) with the bus's
    /// settings, and returns its rows.
    pub(crate) async fn query(
        &self,
        client: &Object,
        sql: &str,
        types: &[Type],
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>> {
        let Some(begin) = &self.begin else {
            let stmt = client.prepare_typed_cached(sql, types).await?;
            return client.query(&stmt, params).await.map_err(|e| {
                if e.code() == Some(&SqlState::INVALID_SQL_STATEMENT_NAME) {
                    crate::warn_limited!(
                        gate = &*self.pooler_hint;
                        error = %e,
                        "a prepared statement of pgbus's disappeared from its connection: if \
                         this address is a transaction-mode pooler, say so \
                         (ConnectConfig::pooler, `consume --pooler`, PGBUS_POOLER=1)"
                    );
                }
                e.into()
            });
        };
        let typed: Vec<(&(dyn ToSql + Sync), Type)> = params
            .iter()
            .zip(types)
            .map(|(p, t)| (*p, t.clone()))
            .collect();
        // Sent together: the server runs them in order; a failed statement turns the
        // COMMIT into a rollback.
        let (begun, rows, committed) = futures::join!(
            client.batch_execute(begin),
            client.query_typed(sql, &typed),
            client.batch_execute("COMMIT"),
        );
        begun?;
        let rows = rows?;
        committed?;
        Ok(rows)
    }

    /// Runs `work`, [`Db::query`] statements on `client`, as one transaction on a direct
    /// connection (one for the server's count, one snapshot); behind a pooler each
    /// statement is a transaction of its own, as [`Db::query`] sends it.
    pub(crate) async fn in_one_transaction<T>(
        &self,
        client: &tokio_postgres::Client,
        work: impl Future<Output = Result<T>>,
    ) -> Result<T> {
        if self.begin.is_some() {
            return work.await;
        }
        transaction(client, "BEGIN", work).await
    }

    /// Runs `work`, statements on `client` that are not one of [`Db::query`]'s (an
    /// operator function of `admin`), under the bus's settings: as they are on a direct
    /// connection; behind a pooler, in a transaction that sets them locally.
    pub(crate) async fn with_settings<T>(
        &self,
        client: &tokio_postgres::Client,
        work: impl Future<Output = Result<T>>,
    ) -> Result<T> {
        let Some(begin) = &self.begin else {
            return work.await;
        };
        transaction(client, begin, work).await
    }

    /// Runs `work` (statements on `client`) unless `stop` fires first; then the
    /// statement in flight is cancelled on the server (it rolls back, at its own
    /// boundary) and `None` is returned. A statement abandoned without a cancel would run
    /// on, and might commit, after the bus said it had stopped.
    pub(crate) async fn unless_stopped<T>(
        &self,
        client: &tokio_postgres::Client,
        stop: &CancellationToken,
        work: impl Future<Output = Result<T>>,
    ) -> Option<Result<T>> {
        tokio::select! {
            r = work => Some(r),
            _ = stop.cancelled() => {
                if let Err(e) = self.connect.cancel(client).await {
                    tracing::debug!(error = %e, "pgbus could not cancel a statement");
                }
                None
            }
        }
    }
}

/// Runs `work` on `client` between `begin` and a COMMIT, or a ROLLBACK when it fails: a
/// failed statement already ended the transaction's work, and a broken connection ends it
/// with the session.
async fn transaction<T>(
    client: &tokio_postgres::Client,
    begin: &str,
    work: impl Future<Output = Result<T>>,
) -> Result<T> {
    client.batch_execute(begin).await?;
    match work.await {
        Ok(done) => {
            client.batch_execute("COMMIT").await?;
            Ok(done)
        }
        Err(e) => {
            let _ = client.batch_execute("ROLLBACK").await;
            Err(e)
        }
    }
}
