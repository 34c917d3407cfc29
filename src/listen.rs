//! The listener: one dedicated connection that LISTENs and turns notifications into a
//! coalescing wake signal for the claimer.
//!
//! The connection is driven by `Connection::poll_message` and read continuously; it never
//! runs a transaction. A notification is only a hint: after every wake-up the claimer
//! reads the tables. While the listener is disconnected, notifications are lost; so after
//! every (re)connect it wakes the claimer once to catch up on whatever committed in
//! between, and the claimer's fallback poll timer bounds the wait if even that fails.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::Notify;
use tokio_postgres::{AsyncMessage, Client};
use tokio_util::sync::CancellationToken;

use crate::backoff::{self, WarnGate};
use crate::metrics::Wakeup;
use crate::stats::{self, Counters};

/// The channel pgbus notifies on.
pub(crate) const CHANNEL: &str = "pgbus";

/// The payload `pgbus.leave` notifies with when the bus leaving led the maintenance.
const LEADER_LEFT: &str = "leader";

/// How often the listener pings its connection, and how long a ping may take.
const HEALTH_INTERVAL: Duration = Duration::from_secs(10);
const HEALTH_TIMEOUT: Duration = Duration::from_secs(5);

/// The claimer's wake signal: coalescing (many wake-ups while it claims make one more
/// claim), and it remembers whether the pending wake-up came from a notification.
#[derive(Debug, Default)]
pub(crate) struct Wake {
    notify: Notify,
    notified: AtomicBool,
    /// The maintenance leader gave up its leadership (`pgbus.leave` notified 'leader').
    leader_left: Notify,
}

impl Wake {
    /// A notification arrived.
    pub(crate) fn by_notification(&self) {
        self.notified.store(true, Ordering::Release);
        self.notify.notify_one();
    }

    /// Something else may have made work (a catch-up, a retry scheduled, a lease reaped).
    pub(crate) fn now(&self) {
        self.notify.notify_one();
    }

    /// A notification said the maintenance leader left: wakes the maintenance task (to
    /// run for leadership at once) as well as the claimer.
    pub(crate) fn by_leader_leaving(&self) {
        self.leader_left.notify_one();
        self.by_notification();
    }

    /// Waits until a leader leaves.
    pub(crate) async fn leader_left(&self) {
        self.leader_left.notified().await;
    }

    /// Waits for a wake-up; true when it came from a notification.
    pub(crate) async fn woken(&self) -> bool {
        self.notify.notified().await;
        self.notified.swap(false, Ordering::AcqRel)
    }
}

/// What the listener needs: where to wake, what to count, and a flag for
/// [`RunningBus::is_listening`](crate::RunningBus::is_listening).
#[derive(Debug)]
pub(crate) struct Listener {
    pub(crate) config: crate::connect::ConnectConfig,
    pub(crate) wake: Arc<Wake>,
    pub(crate) listening: Arc<AtomicBool>,
    pub(crate) stats: Arc<Counters>,
}

use crate::connect::Messages;

impl Listener {
    /// Runs until `stop` is cancelled: connects, LISTENs, wakes the claimer once to catch
    /// up, relays notifications until the connection fails, and starts over after a
    /// backoff.
    pub(crate) async fn run(self, stop: CancellationToken) {
        let gate = WarnGate::default();
        let mut failures: u32 = 0;
        let mut connected_before = false;
        loop {
            let connected = tokio::select! {
                _ = stop.cancelled() => return,
                c = self.connect() => c,
            };
            let reason = match connected {
                Ok((client, messages)) => {
                    self.caught_up(connected_before, failures);
                    connected_before = true;
                    failures = 0;
                    let reason = tokio::select! {
                        _ = stop.cancelled() => None,
                        r = self.relay(&client, messages) => Some(r),
                    };
                    self.listening.store(false, Ordering::Release);
                    let Some(reason) = reason else { return };
                    lost(&gate, &reason);
                    reason
                }
                Err(e) => {
                    connect_failed(&gate, failures, &e);
                    e
                }
            };
            failures += 1;
            tracing::trace!(error = %reason, failures, "pgbus listener backing off");
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(backoff::delay(failures, Duration::MAX)) => {}
            }
        }
    }

    /// Connects and LISTENs, reading the connection meanwhile (the query completes only
    /// while it is polled; a notification that arrives first wakes the claimer).
    async fn connect(&self) -> Result<(Client, Messages), String> {
        // Bounded by the configuration's startup bound; the error names host and phase.
        let (client, mut messages) = self
            .config
            .connect_raw(self.config.pg_config())
            .await
            .map_err(|e| e.to_string())?;
        {
            let listen = client.batch_execute(crate::sql::LISTEN);
            tokio::pin!(listen);
            loop {
                tokio::select! {
                    r = &mut listen => {
                        r.map_err(|e| e.to_string())?;
                        break;
                    }
                    m = messages.next() => match m {
                        Some(Ok(AsyncMessage::Notification(n))) => self.relay_one(&n),
                        Some(Ok(_)) => {}
                        Some(Err(e)) => return Err(e.to_string()),
                        None => return Err("connection closed".to_string()),
                    },
                }
            }
        }
        Ok((client, messages))
    }

    /// Wakes the claimer for a notification on the bus's channel, and the maintenance
    /// task too when it says the leader left.
    fn relay_one(&self, n: &tokio_postgres::Notification) {
        if n.channel() != CHANNEL {
            return;
        }
        if n.payload() == LEADER_LEFT {
            self.wake.by_leader_leaving();
        } else {
            self.wake.by_notification();
        }
    }

    /// Says the listener is connected, and wakes the claimer to catch up on whatever
    /// committed while no one was listening.
    fn caught_up(&self, connected_before: bool, failures: u32) {
        if connected_before {
            stats::add(&self.stats.reconnects, 1);
            tracing::info!(
                after_failures = failures,
                "pgbus listener reconnected; catching up"
            );
        } else {
            tracing::debug!("pgbus listener connected");
        }
        self.listening.store(true, Ordering::Release);
        self.stats.woke(Wakeup::CatchUp);
        self.wake.now();
    }

    /// Relays notifications until the connection fails or a ping does not come back (a
    /// half-open connection); returns why it ended.
    async fn relay(&self, client: &Client, mut messages: Messages) -> String {
        let pinger = ping(client);
        tokio::pin!(pinger);
        loop {
            tokio::select! {
                m = messages.next() => match m {
                    Some(Ok(AsyncMessage::Notification(n))) => self.relay_one(&n),
                    Some(Ok(_)) => {}
                    Some(Err(e)) => return e.to_string(),
                    None => return "connection closed".to_string(),
                },
                e = &mut pinger => return e,
            }
        }
    }
}

/// Pings every [`HEALTH_INTERVAL`]; returns when a ping fails or times out.
async fn ping(client: &Client) -> String {
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
}

/// Logs the first failure of a series as a warning, the rest at debug level, so a long
/// outage does not flood the log.
fn connect_failed(gate: &WarnGate, failures: u32, error: &str) {
    if failures == 0 {
        crate::warn_limited!(gate = gate; error, "pgbus listener could not connect; retrying with backoff");
    } else {
        tracing::debug!(error, failures, "pgbus listener still cannot connect");
    }
}

fn lost(gate: &WarnGate, reason: &str) {
    crate::warn_limited!(gate = gate; error = %reason, "pgbus listener lost its connection; reconnecting");
}
