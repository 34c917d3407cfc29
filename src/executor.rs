//! What pgbus runs its statements on, and the two helpers every operator function uses
//! to run one.
//!
//! [`Executor`] is the sealed trait behind every function that takes "a client or a
//! transaction": it joins whatever the caller is in. [`one_row`] sends a statement
//! unnamed with its parameter types (one round trip, nothing left on the connection, so
//! it works behind a transaction-mode pooler) and [`needs_grant`] turns PostgreSQL's
//! "permission denied" into the grant the role lacks.

use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{GenericClient, Row};

use crate::error::{Error, Grant, Result};

/// A connection or transaction that pgbus can publish through.
///
/// Implemented for `tokio_postgres::Client` and `Transaction`, and for
/// `deadpool_postgres`'s `Object` (a pooled client), `ClientWrapper` and `Transaction`.
/// Sealed: it cannot be implemented outside pgbus.
pub trait Executor: private::Sealed + Sync {
    /// The tokio-postgres client or transaction underneath.
    type Client: GenericClient + Sync;

    /// Returns the tokio-postgres client or transaction underneath.
    fn client(&self) -> &Self::Client;
}

mod private {
    pub trait Sealed {}
}

impl private::Sealed for tokio_postgres::Client {}
impl Executor for tokio_postgres::Client {
    type Client = Self;
    fn client(&self) -> &Self {
        self
    }
}

impl private::Sealed for tokio_postgres::Transaction<'_> {}
impl<'a> Executor for tokio_postgres::Transaction<'a> {
    type Client = Self;
    fn client(&self) -> &Self {
        self
    }
}

impl private::Sealed for deadpool_postgres::ClientWrapper {}
impl Executor for deadpool_postgres::ClientWrapper {
    type Client = tokio_postgres::Client;
    fn client(&self) -> &tokio_postgres::Client {
        self
    }
}

impl private::Sealed for deadpool_postgres::Object {}
impl Executor for deadpool_postgres::Object {
    type Client = tokio_postgres::Client;
    fn client(&self) -> &tokio_postgres::Client {
        self
    }
}

impl private::Sealed for deadpool_postgres::Transaction<'_> {}
impl<'a> Executor for deadpool_postgres::Transaction<'a> {
    type Client = tokio_postgres::Transaction<'a>;
    fn client(&self) -> &tokio_postgres::Transaction<'a> {
        self
    }
}

/// A statement's parameter with its type, as `query_typed` takes it.
pub(crate) type Param<'a> = (&'a (dyn ToSql + Sync), Type);

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
                .query_typed(crate::sql::CURRENT_ROLE, &[])
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
