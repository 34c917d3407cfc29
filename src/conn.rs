//! The bus's connections: its own small pool for claims, settlements and maintenance, and
//! statements that a stopping bus cancels on the server rather than abandons.

use std::future::Future;
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio_util::sync::CancellationToken;

use crate::error::{Error, Result};

/// The session settings of the bus's own connections.
#[derive(Debug, Clone)]
pub(crate) struct Session {
    pub(crate) pool_size: usize,
    pub(crate) statement_timeout: Duration,
    pub(crate) synchronous_commit: bool,
}

/// Builds the bus's pool. No connection is opened yet.
pub(crate) fn pool(config: &tokio_postgres::Config, session: &Session) -> Result<Pool> {
    let mut config = config.clone();
    config.application_name("pgbus worker");
    let mut options = config.get_options().unwrap_or("").to_string();
    options.push_str(&format!(
        " -c statement_timeout={}",
        session.statement_timeout.as_millis()
    ));
    if !session.synchronous_commit {
        options.push_str(" -c synchronous_commit=off");
    }
    // Settling, reaping and repairs decide heads from the rows the key locks protect,
    // which only a fresh snapshot per statement shows: whatever the database's default,
    // the bus's own transactions are READ COMMITTED.
    options.push_str(r" -c default_transaction_isolation=read\ committed");
    config.options(options.trim());
    let manager = Manager::from_config(
        config,
        tokio_postgres::NoTls,
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    Pool::builder(manager)
        .max_size(session.pool_size)
        .runtime(Runtime::Tokio1)
        .wait_timeout(Some(Duration::from_secs(10)))
        .create_timeout(Some(Duration::from_secs(10)))
        .recycle_timeout(Some(Duration::from_secs(5)))
        .build()
        // Fails only without a runtime for its timeouts, which is set above.
        .map_err(|_| Error::Unexpected("the bus's connection pool could not be built"))
}

/// Runs `work` (statements on `client`) unless `stop` fires first; then the statement in
/// flight is cancelled on the server (it rolls back, at its own boundary) and `None` is
/// returned. A statement abandoned without a cancel would run on, and might commit, after
/// the bus said it had stopped.
pub(crate) async fn unless_stopped<T>(
    client: &tokio_postgres::Client,
    stop: &CancellationToken,
    work: impl Future<Output = Result<T>>,
) -> Option<Result<T>> {
    tokio::select! {
        r = work => Some(r),
        _ = stop.cancelled() => {
            if let Err(e) = client.cancel_token().cancel_query(tokio_postgres::NoTls).await {
                tracing::debug!(error = %e, "pgbus could not cancel a statement");
            }
            None
        }
    }
}
