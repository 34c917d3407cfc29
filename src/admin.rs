//! Operating the bus: registering subscriptions, and (later) status, dead letters,
//! replay and the retention sweep.

use tokio_postgres::types::{ToSql, Type};

use crate::error::{Error, Result};
use crate::event::{validate_name, validate_pattern};
use crate::publish::Executor;
use tokio_postgres::GenericClient;

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
/// [`Error::Database`] when the statement fails.
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
    let params: [(&(dyn ToSql + Sync), Type); 3] = [
        (&name, Type::TEXT),
        (&patterns, Type::TEXT_ARRAY),
        (&max_attempts, Type::INT4),
    ];
    client
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
        .await?;
    Ok(())
}
