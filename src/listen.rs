//! The listener: one dedicated connection that LISTENs and turns notifications into a
//! coalescing wake signal.
//!
//! The connection is driven by `Connection::poll_message` and read continuously; it never
//! runs a transaction. A notification is only a hint: after every wake-up the claimer
//! reads the tables. While the listener is disconnected, notifications are lost; so after
//! every (re)connect it wakes the claimer once to catch up on whatever committed in
//! between, and the claimer's fallback poll timer bounds the wait if even that fails.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use futures::StreamExt;
use tokio_postgres::AsyncMessage;
use tokio_util::sync::CancellationToken;

use crate::bus::Shared;

/// The channel pgbus notifies on.
pub(crate) const CHANNEL: &str = "pgbus";

/// First reconnect delay; doubles up to [`RECONNECT_MAX`], with full jitter.
const RECONNECT_MIN: Duration = Duration::from_millis(50);
const RECONNECT_MAX: Duration = Duration::from_secs(10);
/// How often the listener pings its connection, and how long a ping may take.
const HEALTH_INTERVAL: Duration = Duration::from_secs(10);
const HEALTH_TIMEOUT: Duration = Duration::from_secs(5);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Runs until `stop` is cancelled.
pub(crate) async fn run(
    shared: Arc<Shared>,
    config: tokio_postgres::Config,
    stop: CancellationToken,
) {
    let mut failures: u32 = 0;
    let mut connected_before = false;
    let gate = WarnGate::default();
    loop {
        let attempt = tokio::select! {
            _ = stop.cancelled() => return,
            r = tokio::time::timeout(CONNECT_TIMEOUT, config.connect(tokio_postgres::NoTls)) => r,
        };
        let (client, mut connection) = match attempt {
            Ok(Ok(pair)) => pair,
            Ok(Err(e)) => {
                log_failure(&gate, failures, &e.to_string());
                failures += 1;
                if !backoff(failures, &stop).await {
                    return;
                }
                continue;
            }
            Err(_) => {
                log_failure(&gate, failures, "connect timed out");
                failures += 1;
                if !backoff(failures, &stop).await {
                    return;
                }
                continue;
            }
        };
        let mut messages = futures::stream::poll_fn(move |cx| connection.poll_message(cx)).boxed();

        // LISTEN, while reading the connection (the query only completes if it is polled).
        let listen = client.batch_execute("LISTEN pgbus");
        tokio::pin!(listen);
        let listened = loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                r = &mut listen => break r.map_err(|e| e.to_string()),
                m = messages.next() => match m {
                    Some(Ok(AsyncMessage::Notification(_))) => shared.wake_by_notification(),
                    Some(Ok(_)) => {}
                    Some(Err(e)) => break Err(e.to_string()),
                    None => break Err("connection closed".to_string()),
                },
            }
        };
        if let Err(e) = listened {
            log_failure(&gate, failures, &e);
            failures += 1;
            if !backoff(failures, &stop).await {
                return;
            }
            continue;
        }
        if connected_before {
            shared.stats.reconnects.fetch_add(1, Ordering::Relaxed);
            tracing::info!(
                after_failures = failures,
                "pgbus listener reconnected; catching up"
            );
        } else {
            tracing::debug!("pgbus listener connected");
        }
        connected_before = true;
        shared.listening.store(true, Ordering::Release);
        // Catch up on whatever committed while no one was listening.
        shared.wake_for_catch_up();

        // Detects a half-open connection: a ping that fails or does not return in time.
        let pinger = async {
            let mut health = tokio::time::interval(HEALTH_INTERVAL);
            health.tick().await;
            loop {
                health.tick().await;
                match tokio::time::timeout(HEALTH_TIMEOUT, client.simple_query("")).await {
                    Ok(Ok(_)) => {}
                    Ok(Err(e)) => return e.to_string(),
                    Err(_) => return "health check timed out".to_string(),
                }
            }
        };
        tokio::pin!(pinger);
        let reason = loop {
            tokio::select! {
                _ = stop.cancelled() => {
                    shared.listening.store(false, Ordering::Release);
                    return;
                }
                m = messages.next() => match m {
                    Some(Ok(AsyncMessage::Notification(n))) => {
                        if n.channel() == CHANNEL {
                            shared.wake_by_notification();
                        }
                    }
                    Some(Ok(_)) => {}
                    Some(Err(e)) => break e.to_string(),
                    None => break "connection closed".to_string(),
                },
                e = &mut pinger => break e,
            }
        };
        shared.listening.store(false, Ordering::Release);
        if gate.allow() {
            tracing::warn!(error = %reason, "pgbus listener lost its connection; reconnecting");
        } else {
            tracing::debug!(error = %reason, "pgbus listener lost its connection again");
        }
        failures = 1;
        if !backoff(failures, &stop).await {
            return;
        }
    }
}

/// Logs the first failure of a series as a warning, the rest at debug level, so a long
/// outage does not flood the log.
fn log_failure(gate: &WarnGate, failures: u32, error: &str) {
    if failures == 0 && gate.allow() {
        tracing::warn!(
            error,
            "pgbus listener could not connect; retrying with backoff"
        );
    } else {
        tracing::debug!(error, failures, "pgbus listener still cannot connect");
    }
}

/// Sleeps a jittered exponential backoff; false when stopped meanwhile.
async fn backoff(failures: u32, stop: &CancellationToken) -> bool {
    let delay = backoff_delay(failures);
    tokio::select! {
        _ = stop.cancelled() => false,
        _ = tokio::time::sleep(delay) => true,
    }
}

/// How often a task may log the start of an outage as a warning.
pub(crate) const WARN_EVERY: Duration = Duration::from_secs(60);

/// Lets a task log the start of an outage as a warning at most once per [`WARN_EVERY`]:
/// a connection that flaps (a connection limit reached and freed many times a second)
/// would otherwise log a warning per flap. What it holds back goes to debug level.
#[derive(Debug, Default)]
pub(crate) struct WarnGate(std::sync::Mutex<Option<tokio::time::Instant>>);

impl WarnGate {
    /// Whether to warn now (and, if so, not again for a while).
    pub(crate) fn allow(&self) -> bool {
        let mut last = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let now = tokio::time::Instant::now();
        if last.is_some_and(|l| now.duration_since(l) < WARN_EVERY) {
            return false;
        }
        *last = Some(now);
        true
    }
}

pub(crate) fn backoff_delay(failures: u32) -> Duration {
    let exp = failures.saturating_sub(1).min(16);
    let ceiling =
        (RECONNECT_MIN.as_secs_f64() * 2f64.powi(exp as i32)).min(RECONNECT_MAX.as_secs_f64());
    // Full jitter, but never less than half the first delay.
    Duration::from_secs_f64((ceiling * fastrand::f64()).max(RECONNECT_MIN.as_secs_f64() / 2.0))
}
