//! The bus: its builder, and the running bus that ties the listener, the claimer, the
//! dispatcher, the acker and the maintenance tasks together.

use std::collections::HashMap;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::{FutureExt, StreamExt};
use tokio::sync::{Notify, Semaphore, mpsc};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;
use tracing::Instrument;

use crate::claim::{self, ClaimStream};
use crate::dispatch::{
    DynHandler, FnHandler, Handler, SubRuntime, SubscriptionOptions, Target, panic_message,
};
use crate::error::{Error, HandlerError, Result};
use crate::event::Event;
use crate::retry::RetryPolicy;
use crate::subscribe::{Action, SettleMsg, Subscription};

/// Default fallback poll interval: 1 s. Bounds the latency when a notification is lost.
pub const DEFAULT_POLL_INTERVAL: Duration = Duration::from_secs(1);
/// Default claim batch: 100 deliveries per claim statement.
pub const DEFAULT_BATCH_SIZE: usize = 100;
/// Default concurrency: 16 deliveries handled at once per bus.
pub const DEFAULT_CONCURRENCY: usize = 16;
/// Default lease: 60 s, extended every third of it while the handler runs.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(60);
/// Default handler timeout: none (the lease is extended while a handler runs).
pub const DEFAULT_HANDLER_TIMEOUT: Option<Duration> = None;
/// Default time `shutdown` waits for in-flight handlers: 30 s.
pub const DEFAULT_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(30);
/// Default size of the bus's own connection pool: 4.
pub const DEFAULT_POOL_SIZE: usize = 4;
/// Default `synchronous_commit` of the bus's own transactions: off. A claim is a write, and
/// waiting for its WAL flush sits between a commit and its handler: measured here, idle
/// latency p50 0.85 ms with it on and 0.66 ms off, drain 18,166/s on and 22,230/s off
/// (BENCHMARKS.md).
pub const DEFAULT_SYNCHRONOUS_COMMIT: bool = false;
/// Default `statement_timeout` of the bus's own statements: 30 s.
pub const DEFAULT_STATEMENT_TIMEOUT: Duration = Duration::from_secs(30);
/// Default byte budget of claimed, unsettled deliveries: 16 MiB (see
/// [`BusBuilder::claim_bytes`]).
pub const DEFAULT_CLAIM_BYTES: usize = 16 * 1024 * 1024;

/// Default retention of the log: 7 days (see [`BusBuilder::retention`]).
pub const DEFAULT_RETENTION: Duration = crate::admin::DEFAULT_RETENTION;
/// How often a bus runs the retention sweep (one batch, then more batches on the
/// following poll ticks while batches come back full).
const SWEEP_INTERVAL: Duration = Duration::from_secs(3600);

/// How long a bus's row in `pgbus.consumers` stays live without a heartbeat.
pub(crate) const CONSUMER_TTL: Duration = Duration::from_secs(30);
/// How often the bus renews it.
const CONSUMER_HEARTBEAT: Duration = Duration::from_secs(10);
/// How often a bus with ordered subscriptions looks for keys left without a head.
const REPAIR_INTERVAL: Duration = Duration::from_secs(300);

/// The bus's settings (see the setters of [`BusBuilder`] for each default).
#[derive(Debug, Clone)]
pub(crate) struct Options {
    pub(crate) poll_interval: Duration,
    pub(crate) batch_size: usize,
    pub(crate) concurrency: usize,
    pub(crate) lease: Duration,
    pub(crate) handler_timeout: Option<Duration>,
    pub(crate) shutdown_timeout: Duration,
    pub(crate) poll_only: bool,
    pub(crate) pool_size: usize,
    pub(crate) statement_timeout: Duration,
    pub(crate) retry: RetryPolicy,
    pub(crate) synchronous_commit: bool,
    pub(crate) retention: Option<Duration>,
    /// Whether `retry` was set on the builder (its maximum attempts then count as asked).
    pub(crate) retry_set: bool,
    pub(crate) reconfigure: bool,
    pub(crate) claim_bytes: usize,
}

/// Counters of a running bus, read with [`RunningBus::stats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stats {
    /// Deliveries completed (acknowledged and written).
    pub delivered: u64,
    /// Failed attempts written (each retried or dead-lettered).
    pub failed: u64,
    /// Deliveries that became dead letters here.
    pub dead_lettered: u64,
    /// Claimed deliveries released unstarted (at shutdown, or dropped while buffered).
    pub released: u64,
    /// Settlements rejected because the lease had been taken over (stale worker).
    pub stale_rejected: u64,
    /// Claim statements run.
    pub claims: u64,
    /// Wake-ups caused by a notification.
    pub wakeups_by_notification: u64,
    /// Wake-ups by the fallback poll timer.
    pub wakeups_by_poll: u64,
    /// Poll wake-ups whose claim found work that no notification had announced.
    pub polls_found_work: u64,
    /// Times the listener reconnected.
    pub reconnects: u64,
    /// Expired leases this bus returned to pending or dead-lettered.
    pub reaped: u64,
    /// Claim statements that failed.
    pub claim_errors: u64,
    /// Settlements given up: a batch that could not be written, or, once a refused batch
    /// is split, each single settlement PostgreSQL still refuses.
    pub settle_errors: u64,
    /// Ordering keys found without a head and repaired (should stay 0).
    pub repaired: u64,
}

#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) delivered: AtomicU64,
    pub(crate) failed: AtomicU64,
    pub(crate) dead_lettered: AtomicU64,
    pub(crate) released: AtomicU64,
    pub(crate) stale_rejected: AtomicU64,
    pub(crate) claims: AtomicU64,
    pub(crate) wakeups_by_notification: AtomicU64,
    pub(crate) wakeups_by_poll: AtomicU64,
    pub(crate) polls_found_work: AtomicU64,
    pub(crate) reconnects: AtomicU64,
    pub(crate) reaped: AtomicU64,
    pub(crate) claim_errors: AtomicU64,
    pub(crate) settle_errors: AtomicU64,
    pub(crate) repaired: AtomicU64,
}

impl Counters {
    fn snapshot(&self) -> Stats {
        let r = |c: &AtomicU64| c.load(Ordering::Relaxed);
        Stats {
            delivered: r(&self.delivered),
            failed: r(&self.failed),
            dead_lettered: r(&self.dead_lettered),
            released: r(&self.released),
            stale_rejected: r(&self.stale_rejected),
            claims: r(&self.claims),
            wakeups_by_notification: r(&self.wakeups_by_notification),
            wakeups_by_poll: r(&self.wakeups_by_poll),
            polls_found_work: r(&self.polls_found_work),
            reconnects: r(&self.reconnects),
            reaped: r(&self.reaped),
            claim_errors: r(&self.claim_errors),
            settle_errors: r(&self.settle_errors),
            repaired: r(&self.repaired),
        }
    }
}

/// A stream subscription's receiving end, kept so that shutdown can release what it
/// buffered.
type StreamRx = (
    Arc<str>,
    Arc<Mutex<mpsc::UnboundedReceiver<crate::subscribe::Delivery>>>,
);

/// A handler as registered on the builder: name, patterns, handler, options.
type HandlerSpec = (
    String,
    Vec<String>,
    Arc<dyn DynHandler>,
    SubscriptionOptions,
);

/// State shared by the tasks of one running bus.
pub(crate) struct Shared {
    pub(crate) pool: deadpool_postgres::Pool,
    pub(crate) worker_id: String,
    pub(crate) opts: Options,
    pub(crate) subs: HashMap<Arc<str>, Arc<SubRuntime>>,
    /// Wakes the claimer (coalescing: many wake-ups while it claims make one more claim).
    pub(crate) wake: Notify,
    /// Set when the pending wake-up came from a notification.
    pub(crate) notified: AtomicBool,
    /// Signalled whenever a delivery is settled (a slot may have freed).
    pub(crate) capacity_changed: Notify,
    /// Slots for claimed, unsettled deliveries: concurrency plus one batch.
    pub(crate) capacity: Arc<Semaphore>,
    /// Deliveries claimed and not yet settled in the database, with their attempt.
    pub(crate) held: Mutex<HashMap<(Arc<str>, i64), i32>>,
    pub(crate) settle_tx: mpsc::UnboundedSender<SettleMsg>,
    pub(crate) stats: Counters,
    pub(crate) listening: AtomicBool,
    /// Warnings at the start of an outage, at most one a minute per task.
    pub(crate) claim_warn: crate::listen::WarnGate,
    pub(crate) settle_warn: crate::listen::WarnGate,
    pub(crate) lease_warn: crate::listen::WarnGate,
    /// This bus's subscriptions found dropped by the last consumer heartbeat.
    pub(crate) missing: Mutex<Vec<String>>,
    pub(crate) stopping: CancellationToken,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("worker_id", &self.worker_id)
            .finish_non_exhaustive()
    }
}

impl Shared {
    pub(crate) fn wake_by_notification(&self) {
        self.notified.store(true, Ordering::Release);
        self.wake.notify_one();
    }

    pub(crate) fn wake_for_catch_up(&self) {
        self.wake.notify_one();
    }
}

/// A bus that is configured but not yet running: register in-process subscriptions with
/// [`Bus::subscribe`], then [`Bus::start`] it.
pub struct Bus {
    config: tokio_postgres::Config,
    listen_config: Option<tokio_postgres::Config>,
    opts: Options,
    subs: Vec<Arc<SubRuntime>>,
    stopping: CancellationToken,
    streams: Vec<StreamRx>,
}

impl std::fmt::Debug for Bus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bus")
            .field("opts", &self.opts)
            .field("subscriptions", &self.subs)
            .finish_non_exhaustive()
    }
}

/// Configures a [`Bus`]. Every setter documents its default; `build` checks the
/// configuration and does no I/O.
pub struct BusBuilder {
    config: tokio_postgres::Config,
    listen_config: Option<tokio_postgres::Config>,
    opts: Options,
    handlers: Vec<HandlerSpec>,
}

impl std::fmt::Debug for BusBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BusBuilder")
            .field("opts", &self.opts)
            .field(
                "handlers",
                &self.handlers.iter().map(|h| &h.0).collect::<Vec<_>>(),
            )
            .finish_non_exhaustive()
    }
}

impl Bus {
    /// Starts configuring a bus that connects with `config` (e.g.
    /// `"postgres://app@db/app".parse()?`).
    ///
    /// The bus opens its own small pool for claims, acknowledgements and lease
    /// extensions, so handlers that use the application's pool can never starve it, and
    /// one dedicated connection for LISTEN.
    pub fn builder(config: tokio_postgres::Config) -> BusBuilder {
        BusBuilder {
            config,
            listen_config: None,
            opts: Options {
                poll_interval: DEFAULT_POLL_INTERVAL,
                batch_size: DEFAULT_BATCH_SIZE,
                concurrency: DEFAULT_CONCURRENCY,
                lease: DEFAULT_LEASE,
                handler_timeout: DEFAULT_HANDLER_TIMEOUT,
                shutdown_timeout: DEFAULT_SHUTDOWN_TIMEOUT,
                poll_only: false,
                pool_size: DEFAULT_POOL_SIZE,
                statement_timeout: DEFAULT_STATEMENT_TIMEOUT,
                retry: RetryPolicy::default(),
                synchronous_commit: DEFAULT_SYNCHRONOUS_COMMIT,
                retention: Some(DEFAULT_RETENTION),
                retry_set: false,
                reconfigure: false,
                claim_bytes: DEFAULT_CLAIM_BYTES,
            },
            handlers: Vec::new(),
        }
    }

    /// Adds an in-process subscription and returns the stream of its deliveries, which
    /// yields once the bus is started. See [`Subscription`].
    ///
    /// # Errors
    ///
    /// [`Error::Invalid`] for a bad name or pattern, or a name already used by another
    /// subscription of this bus.
    pub fn subscribe<I, S>(&mut self, name: &str, patterns: I) -> Result<Subscription>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.subscribe_with(name, patterns, SubscriptionOptions::default())
    }

    /// [`Bus::subscribe`] with per-subscription options.
    ///
    /// # Errors
    ///
    /// As [`Bus::subscribe`].
    pub fn subscribe_with<I, S>(
        &mut self,
        name: &str,
        patterns: I,
        options: SubscriptionOptions,
    ) -> Result<Subscription>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let patterns: Vec<String> = patterns.into_iter().map(Into::into).collect();
        let asked = asked_settings(name, patterns, &options, &self.opts)?;
        if self.subs.iter().any(|s| &*s.name == name) {
            return Err(Error::invalid(
                "subscription name",
                format!("{name:?} is already used by this bus"),
            ));
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let limit = options.concurrency.unwrap_or(self.opts.concurrency);
        let sub = Arc::new(SubRuntime {
            name: Arc::from(name),
            asked,
            retry: options.retry.unwrap_or(self.opts.retry),
            timeout: None,
            held: Default::default(),
            limit: Some(limit),
            run_limit: None,
            target: Target::Stream(tx),
        });
        let rx = Arc::new(Mutex::new(rx));
        self.streams.push((sub.name.clone(), rx.clone()));
        self.subs.push(sub);
        Ok(Subscription {
            name: Arc::from(name),
            rx,
            stopped: Box::pin(self.stopping.clone().cancelled_owned()),
        })
    }

    /// Connects, registers this bus's subscriptions and itself, and starts its tasks:
    /// the listener, the claimer and dispatcher, the acker, and the maintenance task
    /// (reaper, lease extension, heartbeat).
    ///
    /// # Errors
    ///
    /// [`Error::SchemaMissing`] when the database was never migrated (run
    /// `pgbus migrate`), [`Error::Pool`] or [`Error::Database`] when PostgreSQL cannot be
    /// reached.
    pub async fn start(self) -> Result<RunningBus> {
        let Bus {
            config,
            listen_config,
            opts,
            subs,
            stopping,
            streams,
        } = self;
        let mut worker_config = config.clone();
        worker_config.application_name("pgbus worker");
        let mut options = worker_config.get_options().unwrap_or("").to_string();
        options.push_str(&format!(
            " -c statement_timeout={}",
            opts.statement_timeout.as_millis()
        ));
        if !opts.synchronous_commit {
            options.push_str(" -c synchronous_commit=off");
        }
        // Settling, reaping and repairs decide heads from the rows the key locks protect,
        // which only a fresh snapshot per statement shows: whatever the database's
        // default, the bus's own transactions are READ COMMITTED.
        options.push_str(r" -c default_transaction_isolation=read\ committed");
        worker_config.options(options.trim());
        let manager = deadpool_postgres::Manager::from_config(
            worker_config,
            tokio_postgres::NoTls,
            deadpool_postgres::ManagerConfig {
                recycling_method: deadpool_postgres::RecyclingMethod::Fast,
            },
        );
        let pool = deadpool_postgres::Pool::builder(manager)
            .max_size(opts.pool_size)
            .runtime(deadpool_postgres::Runtime::Tokio1)
            .wait_timeout(Some(Duration::from_secs(10)))
            .create_timeout(Some(Duration::from_secs(10)))
            .recycle_timeout(Some(Duration::from_secs(5)))
            .build()
            .map_err(|e| Error::invalid("pool", e.to_string()))?;

        // Join (or create) the subscriptions: a bus never silently changes a stored
        // subscription that other consumers share.
        {
            let client = pool.get().await?;
            for sub in &subs {
                crate::admin::join_subscription(&client, &sub.name, &sub.asked, opts.reconfigure)
                    .await?;
            }
        }

        let (settle_tx, settle_rx) = mpsc::unbounded_channel();
        let shared = Arc::new(Shared {
            pool,
            worker_id: uuid::Uuid::now_v7().to_string(),
            capacity: Arc::new(Semaphore::new(opts.concurrency + opts.batch_size)),
            opts: opts.clone(),
            subs: subs.iter().map(|s| (s.name.clone(), s.clone())).collect(),
            wake: Notify::new(),
            notified: AtomicBool::new(false),
            capacity_changed: Notify::new(),
            held: Mutex::new(HashMap::new()),
            settle_tx,
            stats: Counters::default(),
            listening: AtomicBool::new(false),
            missing: Mutex::new(Vec::new()),
            claim_warn: Default::default(),
            settle_warn: Default::default(),
            lease_warn: Default::default(),
            stopping: stopping.clone(),
        });
        claim::consumer_heartbeat(&shared).await?;

        let background = CancellationToken::new();
        let acker_stop = CancellationToken::new();
        let acker = AbortOnDropHandle::new(tokio::spawn(claim::run_acker(
            shared.clone(),
            settle_rx,
            acker_stop.clone(),
        )));
        let maintenance = AbortOnDropHandle::new(tokio::spawn(run_maintenance(
            shared.clone(),
            background.clone(),
        )));
        let listener = if opts.poll_only {
            None
        } else {
            let mut cfg = listen_config.unwrap_or(config);
            cfg.application_name("pgbus listener");
            cfg.keepalives(true);
            cfg.keepalives_idle(Duration::from_secs(30));
            Some(AbortOnDropHandle::new(tokio::spawn(crate::listen::run(
                shared.clone(),
                cfg,
                background.clone(),
            ))))
        };
        let dispatcher = AbortOnDropHandle::new(tokio::spawn(run_dispatcher(
            shared.clone(),
            ClaimStream::new(shared.clone()),
        )));
        tracing::info!(
            worker = %shared.worker_id,
            subscriptions = shared.subs.len(),
            poll_only = opts.poll_only,
            "pgbus started"
        );
        Ok(RunningBus {
            shared,
            streams,
            background,
            acker_stop,
            dispatcher: Some(dispatcher),
            acker: Some(acker),
            maintenance: Some(maintenance),
            listener,
        })
    }
}

impl BusBuilder {
    /// Adds a handler: a subscription named by [`Handler::name`] matching
    /// [`Handler::patterns`].
    pub fn handler<H: Handler>(self, handler: H) -> Self {
        self.handler_with(handler, SubscriptionOptions::default())
    }

    /// Adds a handler with its own options (retry policy, concurrency, timeout).
    pub fn handler_with<H: Handler>(mut self, handler: H, options: SubscriptionOptions) -> Self {
        let name = handler.name().to_string();
        let patterns = handler.patterns();
        self.handlers
            .push((name, patterns, Arc::new(handler), options));
        self
    }

    /// Adds a handler made of a closure that receives each event.
    ///
    /// ```no_run
    /// # fn f(config: tokio_postgres::Config) -> Result<(), pgbus::Error> {
    /// let bus = pgbus::Bus::builder(config)
    ///     .handler_fn("audit", ["order.*"], |event| async move {
    ///         println!("{} {}", event.name, event.payload);
    ///         Ok(())
    ///     })
    ///     .build()?;
    /// # Ok(()) }
    /// ```
    pub fn handler_fn<I, S, F, Fut>(self, name: &str, patterns: I, f: F) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
        F: Fn(Event) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = std::result::Result<(), HandlerError>> + Send + 'static,
    {
        self.handler_fn_with(name, patterns, SubscriptionOptions::default(), f)
    }

    /// [`BusBuilder::handler_fn`] with per-subscription options.
    pub fn handler_fn_with<I, S, F, Fut>(
        mut self,
        name: &str,
        patterns: I,
        options: SubscriptionOptions,
        f: F,
    ) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
        F: Fn(Event) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = std::result::Result<(), HandlerError>> + Send + 'static,
    {
        self.handlers.push((
            name.to_string(),
            patterns.into_iter().map(Into::into).collect(),
            Arc::new(FnHandler { f }),
            options,
        ));
        self
    }

    /// LISTENs with a connection of its own configuration (default: the bus's), e.g. a
    /// direct connection while the pool goes through a transaction-mode pooler, which
    /// cannot carry LISTEN.
    pub fn listen_config(mut self, config: tokio_postgres::Config) -> Self {
        self.listen_config = Some(config);
        self
    }

    /// Sets the fallback poll interval (default [`DEFAULT_POLL_INTERVAL`], 1 s): the
    /// longest an event waits when its notification was lost. Expired leases are reaped
    /// at this interval too.
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.opts.poll_interval = interval;
        self
    }

    /// Sets the most deliveries one claim statement takes (default
    /// [`DEFAULT_BATCH_SIZE`], 100). It is also the prefetch: at most concurrency plus
    /// one batch are claimed and unsettled at once.
    pub fn batch_size(mut self, batch: usize) -> Self {
        self.opts.batch_size = batch;
        self
    }

    /// Sets how many deliveries run at once in this bus (default
    /// [`DEFAULT_CONCURRENCY`], 16).
    pub fn concurrency(mut self, concurrency: usize) -> Self {
        self.opts.concurrency = concurrency;
        self
    }

    /// Sets the lease (default [`DEFAULT_LEASE`], 60 s): how long a claimed delivery
    /// stays with this bus without a heartbeat. Leases of running deliveries are
    /// extended every third of it; a crashed bus's deliveries return after it.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.opts.lease = lease;
        self
    }

    /// Sets how long one handler attempt may run before it counts as failed (default:
    /// no limit).
    pub fn handler_timeout(mut self, timeout: Duration) -> Self {
        self.opts.handler_timeout = Some(timeout);
        self
    }

    /// Sets how long `shutdown` waits for in-flight handlers (default
    /// [`DEFAULT_SHUTDOWN_TIMEOUT`], 30 s).
    pub fn shutdown_timeout(mut self, timeout: Duration) -> Self {
        self.opts.shutdown_timeout = timeout;
        self
    }

    /// Runs without a listener, waking only by the poll timer (default: off). For
    /// setups where no connection can LISTEN.
    pub fn poll_only(mut self, poll_only: bool) -> Self {
        self.opts.poll_only = poll_only;
        self
    }

    /// Sets the size of the bus's own pool (default [`DEFAULT_POOL_SIZE`], 4).
    pub fn pool_size(mut self, size: usize) -> Self {
        self.opts.pool_size = size;
        self
    }

    /// Sets the `statement_timeout` of the bus's own statements (default
    /// [`DEFAULT_STATEMENT_TIMEOUT`], 30 s).
    pub fn statement_timeout(mut self, timeout: Duration) -> Self {
        self.opts.statement_timeout = timeout;
        self
    }

    /// Sets the default retry policy and maximum attempts of this bus's subscriptions
    /// (default: [`RetryPolicy::default`], exponential from 1 s, 25 attempts).
    pub fn retry(mut self, retry: RetryPolicy) -> Self {
        self.opts.retry = retry;
        self.opts.retry_set = true;
        self
    }

    /// Lets this bus change the stored settings of its subscriptions to the ones it asks
    /// for (default: off). Off, a bus that explicitly asks for settings other than the
    /// stored ones (patterns, maximum attempts, ordering, dead-head policy) refuses to
    /// start with [`Error::Invalid`] naming the difference; settings it does not set
    /// follow the stored ones. On, the change is made as
    /// [`admin::configure_subscription`](crate::admin::configure_subscription) makes it,
    /// for every consumer of the subscription.
    pub fn reconfigure(mut self, reconfigure: bool) -> Self {
        self.opts.reconfigure = reconfigure;
        self
    }

    /// Whether the bus's own transactions (claims, settlements, lease extensions, reaping)
    /// wait for their WAL flush (default [`DEFAULT_SYNCHRONOUS_COMMIT`]: off). Off is safe
    /// for at-least-once delivery: what a server crash loses of them (the last few hundred
    /// milliseconds) comes back as redeliveries, never as lost events. Publishing is the
    /// caller's transaction and keeps the caller's durability.
    pub fn synchronous_commit(mut self, on: bool) -> Self {
        self.opts.synchronous_commit = on;
        self
    }

    /// Sets how long events stay in the log once no delivery needs them (default
    /// [`DEFAULT_RETENTION`], 7 days): the window for idempotent publishing and replay.
    /// The bus sweeps older events hourly, one bounded batch at a time, at most one
    /// process at a time across all buses (see [`admin::sweep_batch`](crate::admin::sweep_batch)).
    /// `None` or zero: this bus never sweeps.
    pub fn retention(mut self, retention: Option<Duration>) -> Self {
        self.opts.retention = retention.filter(|r| !r.is_zero());
        self
    }

    /// Sets the byte budget of claimed, unsettled deliveries (default
    /// [`DEFAULT_CLAIM_BYTES`], 16 MiB), so that memory is bounded by bytes as well as by
    /// count. A claim leases, oldest first, only the deliveries whose payloads and headers
    /// fit in what is left of the budget (by their stored size in PostgreSQL), and no
    /// claim is made while the JSON held by unsettled deliveries fills it. A delivery
    /// larger than the budget still flows, alone; so the JSON held stays within the budget
    /// plus one claim. 0 claims one delivery at a time.
    pub fn claim_bytes(mut self, bytes: usize) -> Self {
        self.opts.claim_bytes = bytes;
        self
    }

    /// Checks the configuration. Does no I/O.
    ///
    /// # Errors
    ///
    /// [`Error::Invalid`] for a zero batch, concurrency, pool size or poll interval, a
    /// lease under one second, or a handler with a bad or duplicate name or pattern.
    pub fn build(self) -> Result<Bus> {
        let o = &self.opts;
        if o.batch_size == 0 || o.batch_size > 10_000 {
            return Err(Error::invalid("batch size", "must be 1 to 10000"));
        }
        if o.concurrency == 0 {
            return Err(Error::invalid("concurrency", "must be at least 1"));
        }
        if o.pool_size < 2 {
            return Err(Error::invalid("pool size", "must be at least 2"));
        }
        if o.poll_interval.is_zero() {
            return Err(Error::invalid("poll interval", "must be positive"));
        }
        if o.lease < Duration::from_secs(1) {
            return Err(Error::invalid("lease", "must be at least 1 second"));
        }
        let mut subs: Vec<Arc<SubRuntime>> = Vec::new();
        for (name, patterns, handler, options) in self.handlers {
            let asked = asked_settings(&name, patterns, &options, o)?;
            if subs.iter().any(|s| *s.name == *name) {
                return Err(Error::invalid(
                    "subscription name",
                    format!("{name:?} is used by two handlers"),
                ));
            }
            subs.push(Arc::new(SubRuntime {
                name: Arc::from(name.as_str()),
                asked,
                retry: options.retry.unwrap_or(o.retry),
                timeout: options.timeout.or(o.handler_timeout),
                held: Default::default(),
                limit: options.concurrency,
                run_limit: options.concurrency.map(|c| Arc::new(Semaphore::new(c))),
                target: Target::Handler(handler),
            }));
        }
        Ok(Bus {
            config: self.config,
            listen_config: self.listen_config,
            opts: self.opts,
            subs,
            stopping: CancellationToken::new(),
            streams: Vec::new(),
        })
    }
}

/// A running bus. [`shutdown`](RunningBus::shutdown) stops it gracefully; dropping it
/// aborts its tasks (deliveries in flight then come back when their leases expire).
pub struct RunningBus {
    shared: Arc<Shared>,
    streams: Vec<StreamRx>,
    background: CancellationToken,
    acker_stop: CancellationToken,
    dispatcher: Option<AbortOnDropHandle<()>>,
    acker: Option<AbortOnDropHandle<()>>,
    maintenance: Option<AbortOnDropHandle<()>>,
    listener: Option<AbortOnDropHandle<()>>,
}

impl std::fmt::Debug for RunningBus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunningBus")
            .field("worker_id", &self.shared.worker_id)
            .finish_non_exhaustive()
    }
}

impl RunningBus {
    /// The counters so far.
    pub fn stats(&self) -> Stats {
        self.shared.stats.snapshot()
    }

    /// This bus's worker id: `locked_by` of the deliveries it holds, and its row in
    /// `pgbus.consumers`.
    pub fn worker_id(&self) -> &str {
        &self.shared.worker_id
    }

    /// Whether the listener is connected and LISTENing now.
    pub fn is_listening(&self) -> bool {
        self.shared.listening.load(Ordering::Acquire)
    }

    /// This bus's subscriptions that an operator dropped while it runs (checked with the
    /// consumer heartbeat, every 10 s): they receive nothing until registered again
    /// (restarting the bus does that). Each drop is also logged at error level.
    pub fn dropped_subscriptions(&self) -> Vec<String> {
        self.shared
            .missing
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Makes the claimer look for work now.
    pub fn wake(&self) {
        self.shared.wake.notify_one();
    }

    /// Stops gracefully: stops claiming; releases claimed deliveries that have not
    /// started (back to pending, attempt not consumed); waits for running handlers up to
    /// the shutdown timeout (those still running then are aborted and count as failed
    /// attempts); writes every pending settlement; removes the bus from
    /// `pgbus.consumers`; and ends every task.
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`] if a task did not end; the bus is stopped regardless.
    pub async fn shutdown(mut self) -> Result<()> {
        let deadline = tokio::time::Instant::now() + self.shared.opts.shutdown_timeout;
        self.shared.stopping.cancel();
        // Release what the streams have buffered but not handed out, before and after
        // the dispatcher ends: a claim under way when stopping began still hands its
        // deliveries over (the dispatcher releases those it gets for streams then).
        self.release_buffered();
        if let Some(d) = self.dispatcher.take() {
            let _ = d.await;
        }
        self.release_buffered();
        // Deliveries still in the application's hands (subscription streams).
        while self.held_count() > 0 && tokio::time::Instant::now() < deadline {
            let _ =
                tokio::time::timeout_at(deadline, self.shared.capacity_changed.notified()).await;
        }
        self.acker_stop.cancel();
        let mut result = Ok(());
        if let Some(a) = self.acker.take()
            && tokio::time::timeout(Duration::from_secs(30), a)
                .await
                .is_err()
        {
            result = Err(Error::Timeout("writing the last settlements"));
        }
        self.background.cancel();
        if let Some(m) = self.maintenance.take() {
            let _ = m.await;
        }
        if let Some(l) = self.listener.take() {
            let _ = l.await;
        }
        if let Err(e) = claim::consumer_remove(&self.shared).await {
            tracing::debug!(error = %e, "pgbus could not remove its consumer row");
        }
        self.shared.pool.close();
        tracing::info!(worker = %self.shared.worker_id, "pgbus stopped");
        result
    }

    fn release_buffered(&self) {
        for (_, rx) in &self.streams {
            let mut rx = rx.lock().unwrap_or_else(|p| p.into_inner());
            while rx.try_recv().is_ok() {}
        }
    }

    fn held_count(&self) -> usize {
        self.shared
            .subs
            .values()
            .map(|s| s.held.load(Ordering::Acquire))
            .sum()
    }
}

/// What a subscription of this bus asks for: its patterns (none: follow the stored
/// ones), and the maximum attempts, ordering and dead-head policy it set explicitly.
fn asked_settings(
    name: &str,
    patterns: Vec<String>,
    options: &SubscriptionOptions,
    opts: &Options,
) -> Result<crate::admin::SubscriptionChange> {
    if patterns.is_empty() {
        crate::event::validate_name("subscription name", name)?;
    } else {
        crate::admin::validate_subscription(name, &patterns)?;
    }
    let retry = options.retry.or(opts.retry_set.then_some(opts.retry));
    Ok(crate::admin::SubscriptionChange {
        patterns: (!patterns.is_empty()).then_some(patterns),
        max_attempts: retry.and_then(|r| r.attempts_if_set()),
        ordered: options.ordered,
        on_dead: options.on_dead,
    })
}

/// Routes each claimed delivery to its subscription: a handler task, or a stream.
async fn run_dispatcher(shared: Arc<Shared>, mut claims: ClaimStream) {
    let run_limit = Arc::new(Semaphore::new(shared.opts.concurrency));
    let mut tasks = JoinSet::new();
    while let Some(delivery) = claims.next().await {
        while tasks.try_join_next().is_some() {}
        let sub = delivery.sub.clone();
        match &sub.target {
            Target::Stream(tx) => {
                // A dropped stream drops the delivery unstarted: it is released. So does
                // a stopping bus, whose streams are no longer read.
                if !shared.stopping.is_cancelled() {
                    let _ = tx.send(delivery);
                }
            }
            Target::Handler(handler) => {
                let handler = handler.clone();
                let run_limit = run_limit.clone();
                let stopping = shared.stopping.clone();
                let default_timeout = sub.timeout;
                let sub_limit = sub.run_limit.clone();
                tasks.spawn(async move {
                    let mut delivery = delivery;
                    let _permit = tokio::select! {
                        p = run_limit.acquire_owned() => p,
                        // Never started: dropping it releases it.
                        _ = stopping.cancelled() => return,
                    };
                    let _sub_permit = match sub_limit {
                        Some(limit) => tokio::select! {
                            p = limit.acquire_owned() => Some(p),
                            _ = stopping.cancelled() => return,
                        },
                        None => None,
                    };
                    delivery.mark_started();
                    let event = &delivery.event;
                    let span = tracing::info_span!(
                        "pgbus.deliver",
                        messaging.system = "postgresql",
                        messaging.operation = "process",
                        messaging.destination.name = %event.name,
                        messaging.destination.subscription.name = %delivery.sub.name,
                        messaging.message.id = %event.id,
                        messaging.message.conversation_id = event.correlation_id.as_deref(),
                        pgbus.attempt = delivery.attempt,
                    );
                    // Called inside the future, so that a handler panicking before it
                    // returns its future (a closure's synchronous part) is caught too.
                    let run = AssertUnwindSafe(async { handler.call(event).await }).catch_unwind();
                    let outcome = match default_timeout {
                        Some(t) => tokio::time::timeout(t, run)
                            .instrument(span.clone())
                            .await
                            .ok(),
                        None => Some(run.instrument(span.clone()).await),
                    };
                    let action = match outcome {
                        Some(Ok(Ok(()))) => Action::Ack,
                        Some(Ok(Err(e))) => {
                            span.in_scope(|| tracing::debug!(error = %e, "pgbus handler failed"));
                            delivery.fail_action(&e)
                        }
                        Some(Err(panic)) => {
                            let msg = format!("handler panicked: {}", panic_message(&*panic));
                            span.in_scope(
                                || tracing::warn!(error = %msg, "pgbus handler panicked"),
                            );
                            delivery.fail_action(&HandlerError::new(msg))
                        }
                        None => {
                            let msg = format!(
                                "handler timed out after {:?}",
                                default_timeout.unwrap_or_default()
                            );
                            delivery.fail_action(&HandlerError::new(msg))
                        }
                    };
                    delivery.settle_nowait(action);
                });
            }
        }
    }
    // Stopping: wait for running handlers up to the deadline, then abort the rest (their
    // deliveries count as failed attempts and return at once).
    let deadline = tokio::time::Instant::now() + shared.opts.shutdown_timeout;
    while !tasks.is_empty() {
        match tokio::time::timeout_at(deadline, tasks.join_next()).await {
            Ok(Some(_)) => {}
            Ok(None) => break,
            Err(_) => {
                tracing::warn!(
                    running = tasks.len(),
                    "pgbus shutdown timeout: aborting handlers still running"
                );
                tasks.shutdown().await;
                break;
            }
        }
    }
}

/// The reaper, the lease heartbeat, the consumer heartbeat and the retention sweep.
async fn run_maintenance(shared: Arc<Shared>, stop: CancellationToken) {
    // The first sweep runs on the first tick; then hourly, or on the next tick while
    // batches come back full. One batch per tick keeps the other duties on time.
    let mut next_sweep = tokio::time::Instant::now();
    let mut reap = tokio::time::interval(shared.opts.poll_interval);
    let mut extend = tokio::time::interval(shared.opts.lease / 3);
    let mut heartbeat = tokio::time::interval(CONSUMER_HEARTBEAT);
    let mut repair = tokio::time::interval(REPAIR_INTERVAL);
    for i in [&mut reap, &mut extend, &mut heartbeat, &mut repair] {
        i.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    }
    extend.tick().await;
    heartbeat.tick().await;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = reap.tick() => match claim::reap(&shared).await {
                Ok((pending, dead)) => {
                    if pending + dead > 0 {
                        shared.stats.reaped.fetch_add((pending + dead) as u64, Ordering::Relaxed);
                        tracing::info!(returned = pending, dead, "pgbus reaped expired leases");
                    }
                    if pending > 0 {
                        shared.wake.notify_one();
                    }
                    if let Some(retention) = shared.opts.retention
                        && tokio::time::Instant::now() >= next_sweep
                    {
                        next_sweep = sweep_once(&shared, retention).await;
                    }
                }
                Err(e) => tracing::debug!(error = %e, "pgbus reaper failed"),
            },
            _ = extend.tick() => if let Err(e) = claim::extend_leases(&shared).await {
                if shared.lease_warn.allow() {
                    tracing::warn!(error = %e, "pgbus could not extend leases");
                } else {
                    tracing::debug!(error = %e, "pgbus could not extend leases again");
                }
            },
            _ = heartbeat.tick() => match claim::consumer_heartbeat(&shared).await {
                Ok(missing) => note_missing(&shared, missing),
                Err(e) => tracing::debug!(error = %e, "pgbus consumer heartbeat failed"),
            },
            _ = repair.tick() => {
                match claim::repair_orphans(&shared).await {
                    Ok(0) => {}
                    Ok(n) => {
                        shared.stats.repaired.fetch_add(n as u64, Ordering::Relaxed);
                        shared.wake.notify_one();
                    }
                    Err(e) => tracing::debug!(error = %e, "pgbus ordering repair failed"),
                }
            },
        }
    }
}

/// Records which of this bus's subscriptions were dropped, and says so once per drop.
fn note_missing(shared: &Shared, missing: Vec<String>) {
    let mut known = shared.missing.lock().unwrap_or_else(|p| p.into_inner());
    for name in missing.iter().filter(|n| !known.contains(n)) {
        tracing::error!(
            messaging.destination.subscription.name = %name,
            "pgbus subscription was dropped while this bus consumes it: it receives nothing \
             until it is registered again (restart this consumer, or stop it)"
        );
    }
    for name in known.iter().filter(|n| !missing.contains(n)) {
        tracing::info!(
            messaging.destination.subscription.name = %name,
            "pgbus subscription is registered again"
        );
    }
    *known = missing;
}

/// Runs one retention sweep batch; returns when the next one is due.
async fn sweep_once(shared: &Shared, retention: Duration) -> tokio::time::Instant {
    let later = tokio::time::Instant::now() + SWEEP_INTERVAL;
    let batch = crate::admin::DEFAULT_SWEEP_BATCH;
    let client = match shared.pool.get().await {
        Ok(client) => client,
        Err(e) => {
            tracing::debug!(error = %e, "pgbus sweep could not get a connection");
            return later;
        }
    };
    match crate::admin::sweep_batch(&client, retention, batch).await {
        Ok(swept) => {
            if swept.events > 0 {
                tracing::info!(
                    events = swept.events,
                    failures = swept.failures,
                    "pgbus swept events past retention"
                );
            }
            if swept.events >= batch as u64 {
                tokio::time::Instant::now()
            } else {
                later
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, "pgbus retention sweep failed");
            later
        }
    }
}
