//! Waiting, with a deadline, for what happens in the background.

use std::future::Future;
use std::time::Duration;

use tokio_postgres::Client;

/// How long [`wait_count`] and [`wait_settled`] wait: long enough for a loaded machine,
/// short enough that a test that will never pass fails.
pub const WAIT: Duration = Duration::from_secs(30);

/// How often [`wait_for`] polls.
const POLL_INTERVAL: Duration = Duration::from_millis(10);

/// Polls `condition` every 10 ms until it is true.
///
/// # Panics
///
/// With `what` in the message, when `timeout` passes first.
pub async fn wait_for<F, Fut>(what: &str, timeout: Duration, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        match tokio::time::timeout_at(deadline, condition()).await {
            Ok(true) => return,
            Ok(false) => {}
            Err(_) => break,
        }
        if tokio::time::Instant::now() + POLL_INTERVAL > deadline {
            break;
        }
        tokio::time::sleep(POLL_INTERVAL).await;
    }
    panic!("timed out after {timeout:?} waiting for {what}");
}

/// Awaits `future`.
///
/// # Panics
///
/// With `what` in the message, when `timeout` passes first.
pub async fn within<T>(what: &str, timeout: Duration, future: impl Future<Output = T>) -> T {
    match tokio::time::timeout(timeout, future).await {
        Ok(value) => value,
        Err(_) => panic!("timed out after {timeout:?} waiting for {what}"),
    }
}

/// The `int8` that `sql` (a query of one row, e.g. `SELECT count(*) FROM ...`) returns.
///
/// # Panics
///
/// When the query fails or its first column is not an `int8`.
pub async fn count(client: &Client, sql: &str) -> i64 {
    client.query_one(sql, &[]).await.unwrap().get(0)
}

/// Waits, at most [`WAIT`], until [`count`] of `sql` is `expected`.
///
/// # Panics
///
/// With `what` in the message, when [`WAIT`] passes first; as [`count`].
pub async fn wait_count(client: &Client, what: &str, sql: &str, expected: i64) {
    wait_for(what, WAIT, || async {
        count(client, sql).await == expected
    })
    .await;
}

/// Counts the work left: deliveries, and committed events the bus has not yet turned
/// into deliveries (`pgbus.not_fanned_out`). Makes no deliveries itself.
pub const WORK_LEFT: &str = "SELECT (SELECT count(*) FROM pgbus.deliveries) \
     + (SELECT events FROM pgbus.not_fanned_out(NULL))";

/// Waits, at most [`WAIT`], until no work is left ([`WORK_LEFT`]): every event was
/// turned into deliveries and every delivery acknowledged, by the bus.
///
/// # Panics
///
/// As [`wait_count`].
pub async fn wait_settled(client: &Client, what: &str) {
    wait_count(client, what, WORK_LEFT, 0).await;
}

/// Turns every committed event into deliveries now, as the bus's next claim would
/// (`pgbus.fan_out_committed()`, docs/ARCHITECTURE.md "The log-first publish"), and
/// returns how many events it took. For tests that read `pgbus.deliveries` right after
/// publishing, with no bus running.
pub async fn fan_out(client: &Client) -> i64 {
    client
        .query_one("SELECT pgbus.fan_out_committed()", &[])
        .await
        .expect("pgbus.fan_out_committed()")
        .get(0)
}

/// [`count`] after [`fan_out`]: a count over `pgbus.deliveries` as it stands once the
/// bus has turned every committed event into deliveries.
pub async fn count_after_fan_out(client: &Client, sql: &str) -> i64 {
    fan_out(client).await;
    count(client, sql).await
}
