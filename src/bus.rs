//! The bus: its builder, and the running bus that starts the rooms of the delivery path
//! (listen, claim, dispatch, settle, maintain) and stops them within one deadline.
//!
//! This is the only module that knows every room; each room is handed just the handles
//! it needs.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::de::DeserializeOwned;
use tokio::sync::{Semaphore, mpsc};
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

use crate::backoff::WarnGate;
use crate::claim::{Claimer, Pacing};
use crate::conn::{Db, Session};
use crate::connect::ConnectConfig;
use crate::context::Context;
use crate::delivery::{Delivery, Subscription};
use crate::dispatch::{Dispatcher, Target};
use crate::error::{Error, HandlerError, Result};
use crate::event::Event;
use crate::handler::{ArgFnHandler, DynHandler, FnHandler, Handler, SubscriptionOptions};
use crate::listen::{Listener, Wake};
use crate::maintain::{Consumer, Maintainer, Schedule};
use crate::retry::RetryPolicy;
use crate::settle::{Acker, Settler};
use crate::shutdown::Shutdown;
use crate::slot::{Slots, Sub};
use crate::stats::{Counters, Stats};

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

/// Default length of the maintenance leadership: 60 s (see [`BusBuilder::leader_lease`]).
pub const DEFAULT_LEADER_LEASE: Duration = Duration::from_secs(60);
/// Default fallback poll interval while the listener is connected: 5 minutes (see
/// [`BusBuilder::idle_poll_interval`]).
pub const DEFAULT_IDLE_POLL_INTERVAL: Duration = Duration::from_secs(300);

/// Default retention of the log: 7 days (see [`BusBuilder::retention`]).
pub const DEFAULT_RETENTION: Duration = crate::retention::DEFAULT_RETENTION;
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
    pub(crate) gauge_interval: Option<Duration>,
    pub(crate) long_transaction: Option<Duration>,
    /// Whether `retry` was set on the builder (its maximum attempts then count as asked).
    pub(crate) retry_set: bool,
    pub(crate) reconfigure: bool,
    pub(crate) claim_bytes: usize,
    pub(crate) leader_lease: Duration,
    pub(crate) idle_poll_interval: Duration,
}

/// A stream subscription's receiving end, kept so that shutdown can release what it
/// buffered.
type StreamRx = Arc<Mutex<mpsc::UnboundedReceiver<Delivery>>>;

/// A handler as registered on the builder: name, patterns, handler, options.
type HandlerSpec = (
    String,
    Vec<String>,
    Arc<dyn DynHandler>,
    SubscriptionOptions,
);

/// A subscription of this bus: as the claimer counts it, what it asks of the stored
/// subscription, and where its deliveries go.
#[derive(Debug)]
struct Registered {
    sub: Arc<Sub>,
    asked: crate::subscription::SubscriptionChange,
    target: Target,
}

/// A bus that is configured but not yet running: register in-process subscriptions with
/// [`Bus::subscribe`], then [`Bus::start`] it.
pub struct Bus {
    config: ConnectConfig,
    listen_config: Option<ConnectConfig>,
    opts: Options,
    subs: Vec<Registered>,
    shutdown: Arc<Shutdown>,
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
    config: ConnectConfig,
    listen_config: Option<ConnectConfig>,
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
    /// Starts configuring a bus that connects with `config`: a [`ConnectConfig`]
    /// (e.g. `"postgres://app@db/app?sslmode=verify-full".parse()?`, which reads the
    /// `PG*` environment too) or a `tokio_postgres::Config`.
    ///
    /// The bus opens its own small pool for claims, acknowledgements and lease
    /// extensions, so handlers that use the application's pool can never starve it, and
    /// one dedicated connection for LISTEN.
    pub fn builder(config: impl Into<ConnectConfig>) -> BusBuilder {
        BusBuilder {
            config: config.into(),
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
                gauge_interval: Some(crate::metrics::DEFAULT_GAUGE_INTERVAL),
                leader_lease: DEFAULT_LEADER_LEASE,
                idle_poll_interval: DEFAULT_IDLE_POLL_INTERVAL,
                long_transaction: Some(crate::metrics::DEFAULT_LONG_TRANSACTION_WARNING),
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
        if self.subs.iter().any(|s| &*s.sub.name == name) {
            return Err(Error::invalid(
                "subscription name",
                format!("{name:?} is already used by this bus"),
            ));
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let limit = options.concurrency.unwrap_or(self.opts.concurrency);
        let retry = options.retry.unwrap_or(self.opts.retry);
        let sub = Arc::new(Sub::new(name, retry, Some(limit)));
        let rx = Arc::new(Mutex::new(rx));
        self.streams.push(rx.clone());
        self.subs.push(Registered {
            sub,
            asked,
            target: Target::Stream(tx),
        });
        Ok(Subscription {
            name: Arc::from(name),
            rx,
            stopped: Box::pin(self.shutdown.token().clone().cancelled_owned()),
        })
    }

    /// Connects, registers this bus's subscriptions and itself, and starts its tasks:
    /// the listener, the claimer and dispatcher, the acker, and the maintenance task
    /// (reaper, lease extension, heartbeat, repair, sweep).
    ///
    /// # Errors
    ///
    /// [`Error::SchemaMissing`] when the database was never migrated (run
    /// `pgbus migrate`), [`Error::Pool`] or [`Error::Database`] when PostgreSQL cannot be
    /// reached, [`Error::Invalid`] when a subscription asks for settings other than the
    /// stored ones (and [`BusBuilder::reconfigure`] is off).
    pub async fn start(self) -> Result<RunningBus> {
        let session = Session {
            pool_size: self.opts.pool_size,
            statement_timeout: self.opts.statement_timeout,
            synchronous_commit: self.opts.synchronous_commit,
        };
        let db = Db::new(&self.config, &session)?;
        // Join (or create) the subscriptions: a bus never silently changes a stored
        // subscription that other consumers share.
        {
            let client = db.get().await?;
            for s in &self.subs {
                crate::subscription::join_subscription(
                    &client,
                    &s.sub.name,
                    &s.asked,
                    self.opts.reconfigure,
                )
                .await?;
            }
        }
        let consumer = Consumer {
            db,
            worker: Arc::from(uuid::Uuid::now_v7().to_string()),
            subscriptions: self.subs.iter().map(|s| s.sub.name.clone()).collect(),
            poll_only: self.opts.poll_only,
            // A dead leader's expired leases wait for its successor: never longer for
            // the leadership than for a delivery lease.
            leadership: self.opts.leader_lease.min(self.opts.lease),
        };
        // Registered before any task runs; the maintenance task runs for leadership.
        consumer.beat(false, &CancellationToken::new()).await?;
        let bus = self.spawn(consumer);
        tracing::info!(
            worker = %bus.parts.consumer.worker,
            subscriptions = bus.parts.consumer.subscriptions.len(),
            poll_only = bus.opts.poll_only,
            "pgbus started"
        );
        Ok(bus)
    }

    /// Starts the tasks of a bus whose subscriptions and consumer row are registered.
    fn spawn(self, consumer: Consumer) -> RunningBus {
        let Bus {
            config,
            listen_config,
            opts,
            subs,
            shutdown,
            streams,
        } = self;
        let parts = Parts {
            consumer,
            stats: Arc::default(),
            wake: Arc::default(),
            slots: Slots::new(opts.concurrency + opts.batch_size),
            listening: Arc::default(),
            dropped: Arc::default(),
            leads: Arc::default(),
            shutdown,
        };
        let tokens = Tokens::default();
        let (settler, settle_rx) =
            Settler::channel(parts.consumer.worker.clone(), parts.stats.clone());
        let acker = parts.acker(&tokens).run(settle_rx, tokens.acker.clone());
        let maintenance = parts.maintainer(&opts).run(tokens.background.clone());
        let listener = (!opts.poll_only).then(|| {
            let config = listen_config.unwrap_or(config);
            spawn(parts.listener(config).run(tokens.background.clone()))
        });
        let (claimer, dispatcher) = parts.delivery(&opts, subs, settler);
        let tasks = Tasks {
            dispatcher: Some(spawn(dispatcher.run(claimer.into_stream()))),
            acker: Some(spawn(acker)),
            maintenance: Some(spawn(maintenance)),
            listener,
        };
        RunningBus {
            parts,
            opts,
            streams,
            tokens,
            tasks,
        }
    }
}

/// What the rooms of a running bus share: each is handed the parts it needs.
#[derive(Debug)]
struct Parts {
    consumer: Consumer,
    stats: Arc<Counters>,
    wake: Arc<Wake>,
    slots: Arc<Slots>,
    listening: Arc<AtomicBool>,
    dropped: Arc<Mutex<Vec<String>>>,
    leads: Arc<AtomicBool>,
    shutdown: Arc<Shutdown>,
}

impl Parts {
    fn acker(&self, tokens: &Tokens) -> Acker {
        Acker {
            db: self.consumer.db.clone(),
            worker: self.consumer.worker.clone(),
            stats: self.stats.clone(),
            wake: self.wake.clone(),
            warn: WarnGate::default(),
            deadline: tokens.deadline.clone(),
        }
    }

    fn maintainer(&self, opts: &Options) -> Maintainer {
        Maintainer {
            consumer: self.consumer.clone(),
            slots: self.slots.clone(),
            wake: self.wake.clone(),
            stats: self.stats.clone(),
            shutdown: self.shutdown.clone(),
            schedule: Schedule {
                poll_interval: opts.poll_interval,
                lease: opts.lease,
                retention: opts.retention,
                gauges: opts.gauge_interval,
                long_transaction: opts.long_transaction,
            },
            dropped: self.dropped.clone(),
            lease_warn: WarnGate::default(),
            leads: self.leads.clone(),
        }
    }

    fn listener(&self, mut config: ConnectConfig) -> Listener {
        let pg = config.pg_config_mut();
        pg.application_name("pgbus listener");
        pg.keepalives(true);
        pg.keepalives_idle(Duration::from_secs(30));
        Listener {
            config,
            wake: self.wake.clone(),
            listening: self.listening.clone(),
            stats: self.stats.clone(),
        }
    }

    /// The claimer and the dispatcher: the subscriptions' claim side to the one, their
    /// targets to the other.
    fn delivery(
        &self,
        opts: &Options,
        subs: Vec<Registered>,
        settler: Settler,
    ) -> (Claimer, Dispatcher) {
        let mut targets = HashMap::new();
        let mut claim_subs = HashMap::new();
        for s in subs {
            let name = s.sub.name.clone();
            targets.insert(name.clone(), s.target);
            claim_subs.insert(name, s.sub);
        }
        let claimer = Claimer {
            db: self.consumer.db.clone(),
            worker: self.consumer.worker.clone(),
            subs: claim_subs,
            slots: self.slots.clone(),
            settler,
            wake: self.wake.clone(),
            stats: self.stats.clone(),
            shutdown: self.shutdown.clone(),
            pacing: Pacing {
                batch_size: opts.batch_size,
                claim_bytes: opts.claim_bytes,
                lease: opts.lease,
                poll_interval: opts.poll_interval,
                idle_poll_interval: opts.idle_poll_interval,
                poll_only: opts.poll_only,
            },
            listening: self.listening.clone(),
        };
        let dispatcher = Dispatcher {
            targets,
            concurrency: opts.concurrency,
            shutdown: self.shutdown.clone(),
        };
        (claimer, dispatcher)
    }
}

fn spawn(task: impl Future<Output = ()> + Send + 'static) -> AbortOnDropHandle<()> {
    AbortOnDropHandle::new(tokio::spawn(task))
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
        self,
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
        self.closure(name, patterns, options, Arc::new(FnHandler { f }))
    }

    /// Adds a handler made of a closure that receives each event with its delivery's
    /// [`Context`]: the attempt number, the attempt's deadline, the shutdown signal, and
    /// [`Context::ack_in`] to complete the delivery in the handler's own transaction.
    ///
    /// ```no_run
    /// # fn f(config: tokio_postgres::Config) -> Result<(), pgbus::Error> {
    /// let bus = pgbus::Bus::builder(config)
    ///     .handler_with_context("audit", ["order.*"], |event, cx| async move {
    ///         println!("{} attempt {}", event.name, cx.attempt());
    ///         Ok(())
    ///     })
    ///     .build()?;
    /// # Ok(()) }
    /// ```
    pub fn handler_with_context<I, S, F, Fut>(self, name: &str, patterns: I, f: F) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
        F: Fn(Event, Context) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = std::result::Result<(), HandlerError>> + Send + 'static,
    {
        self.handler_with_context_opts(name, patterns, SubscriptionOptions::default(), f)
    }

    /// [`BusBuilder::handler_with_context`] with per-subscription options.
    pub fn handler_with_context_opts<I, S, F, Fut>(
        self,
        name: &str,
        patterns: I,
        options: SubscriptionOptions,
        f: F,
    ) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
        F: Fn(Event, Context) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = std::result::Result<(), HandlerError>> + Send + 'static,
    {
        self.closure(name, patterns, options, Arc::new(ArgFnHandler::event(f)))
    }

    /// Adds a handler made of a closure that receives each event's payload decoded as `T`
    /// (with serde), and the delivery's [`Context`].
    ///
    /// A payload that does not decode as `T` is a permanent failure: the delivery becomes
    /// a dead letter after that one attempt, with the decoding error as its last error
    /// (`the payload of order.placed does not decode as app::OrderPlaced: missing field
    /// ...`), and the closure is not called. Retry it (`pgbus dead retry`) once a handler
    /// that can read it runs.
    ///
    /// ```no_run
    /// #[derive(serde::Deserialize)]
    /// struct OrderPlaced {
    ///     order_id: i64,
    /// }
    ///
    /// # fn f(config: tokio_postgres::Config) -> Result<(), pgbus::Error> {
    /// let bus = pgbus::Bus::builder(config)
    ///     .handler_typed("receipts", ["order.placed"], |order: OrderPlaced, cx| async move {
    ///         println!("receipt for order {} ({})", order.order_id, cx.event_id());
    ///         Ok(())
    ///     })
    ///     .build()?;
    /// # Ok(()) }
    /// ```
    pub fn handler_typed<T, I, S, F, Fut>(self, name: &str, patterns: I, f: F) -> Self
    where
        T: DeserializeOwned + 'static,
        I: IntoIterator<Item = S>,
        S: Into<String>,
        F: Fn(T, Context) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = std::result::Result<(), HandlerError>> + Send + 'static,
    {
        self.handler_typed_opts(name, patterns, SubscriptionOptions::default(), f)
    }

    /// [`BusBuilder::handler_typed`] with per-subscription options.
    pub fn handler_typed_opts<T, I, S, F, Fut>(
        self,
        name: &str,
        patterns: I,
        options: SubscriptionOptions,
        f: F,
    ) -> Self
    where
        T: DeserializeOwned + 'static,
        I: IntoIterator<Item = S>,
        S: Into<String>,
        F: Fn(T, Context) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = std::result::Result<(), HandlerError>> + Send + 'static,
    {
        self.closure(name, patterns, options, Arc::new(ArgFnHandler::typed(f)))
    }

    /// Registers a closure's handler under `name`.
    fn closure<I, S>(
        mut self,
        name: &str,
        patterns: I,
        options: SubscriptionOptions,
        handler: Arc<dyn DynHandler>,
    ) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.handlers.push((
            name.to_string(),
            patterns.into_iter().map(Into::into).collect(),
            handler,
            options,
        ));
        self
    }

    /// LISTENs with a connection of its own configuration (default: the bus's), e.g. a
    /// direct connection while the pool goes through a transaction-mode pooler, which
    /// cannot carry LISTEN. Without one, a bus whose configuration is a pooler
    /// ([`ConnectConfig::pooler`]) polls, and logs a warning saying so.
    pub fn listen_config(mut self, config: impl Into<ConnectConfig>) -> Self {
        self.listen_config = Some(config.into());
        self
    }

    /// Sets the fallback poll interval (default [`DEFAULT_POLL_INTERVAL`], 1 s): the
    /// longest an event waits when its notification was lost. Expired leases are reaped
    /// at this interval too.
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.opts.poll_interval = interval;
        self
    }

    /// Sets the fallback poll interval while the listener is connected (default
    /// [`DEFAULT_IDLE_POLL_INTERVAL`], 5 minutes). A connected listener hears every
    /// commit that makes work (and catches up after a reconnect), and the bus knows when
    /// its next scheduled or retried delivery is due, so an idle bus need not ask: it
    /// claims on a notification, at the next due time, or after this interval, whichever
    /// comes first. While the listener is down it polls every
    /// [`poll_interval`](Self::poll_interval).
    pub fn idle_poll_interval(mut self, interval: Duration) -> Self {
        self.opts.idle_poll_interval = interval;
        self
    }

    /// Sets how long the maintenance leadership lasts without renewal (default
    /// [`DEFAULT_LEADER_LEASE`], 60 s). One bus at a time leads: it reaps expired leases
    /// (of every bus), repairs ordering keys, sweeps the log and samples the gauges. The
    /// leader renews it every third of this (and at least twice per
    /// [`lease`](Self::lease)); the others try to take it every 1.25 times this. A leader
    /// that shuts down hands over at once; one that dies is replaced within 2.25 times
    /// this. A [`lease`](Self::lease) shorter than this shortens the leadership to it,
    /// so that the leases of a leader that died are reaped within the same order of
    /// time as they run out.
    pub fn leader_lease(mut self, lease: Duration) -> Self {
        self.opts.leader_lease = lease;
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
    /// for every consumer of the subscription; a change needs the operator grant
    /// (`pgbus.grant_operator`) besides the consumer's, and without it the start fails
    /// with [`Error::NeedsGrant`].
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

    /// Sets how often the bus samples the backlog gauges while it leads the maintenance
    /// (default [`DEFAULT_GAUGE_INTERVAL`](crate::metrics::DEFAULT_GAUGE_INTERVAL), 60 s;
    /// the first sample is taken when it is elected): one index-backed statement over the
    /// subscriptions of every live bus, its counts capped (see [`crate::metrics`]). Only
    /// the leader ([`RunningBus::is_leader`]) records them. `None` or zero: never (no recorder is installed, or another
    /// process samples them, e.g. `pgbus metrics`).
    pub fn gauge_interval(mut self, interval: Option<Duration>) -> Self {
        self.opts.gauge_interval = interval.filter(|i| !i.is_zero());
        self
    }

    /// Sets the age past which the oldest transaction holding the database's xmin
    /// horizon back is a warning in the log (default
    /// [`DEFAULT_LONG_TRANSACTION_WARNING`](crate::metrics::DEFAULT_LONG_TRANSACTION_WARNING),
    /// 5 minutes; at most one a minute). It is
    /// sampled with the gauges ([`gauge_interval`](Self::gauge_interval); never without
    /// them) and set as the gauge
    /// [`OLDEST_TRANSACTION_AGE`](crate::metrics::OLDEST_TRANSACTION_AGE). While such a
    /// transaction lasts, VACUUM cannot remove what settled deliveries leave behind and
    /// the bus slows down (docs/operations.md, "A long transaction"). `None`: no warning.
    pub fn long_transaction_warning(mut self, after: Option<Duration>) -> Self {
        self.opts.long_transaction = after;
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
        if o.idle_poll_interval.is_zero() {
            return Err(Error::invalid("idle poll interval", "must be positive"));
        }
        if o.leader_lease < Duration::from_secs(1) {
            return Err(Error::invalid("leader lease", "must be at least 1 second"));
        }
        let mut opts = self.opts.clone();
        if self.config.is_pooler() && self.listen_config.is_none() && !opts.poll_only {
            crate::warn_limited!(
                poll_interval = ?opts.poll_interval,
                "pgbus connects through a transaction-mode pooler, which cannot carry LISTEN, \
                 and has no listen_config: it falls back to polling (give it a direct \
                 connection to LISTEN on, e.g. `consume --listen-url`)"
            );
            opts.poll_only = true;
        }
        let mut subs: Vec<Registered> = Vec::new();
        for (name, patterns, handler, options) in self.handlers {
            let asked = asked_settings(&name, patterns, &options, o)?;
            if subs.iter().any(|s| *s.sub.name == *name) {
                return Err(Error::invalid(
                    "subscription name",
                    format!("{name:?} is used by two handlers"),
                ));
            }
            let retry = options.retry.unwrap_or(o.retry);
            subs.push(Registered {
                sub: Arc::new(Sub::new(&name, retry, options.concurrency)),
                asked,
                target: Target::Handler {
                    handler,
                    timeout: options.timeout.or(o.handler_timeout),
                    limit: options.concurrency.map(|c| Arc::new(Semaphore::new(c))),
                },
            });
        }
        Ok(Bus {
            config: self.config,
            listen_config: self.listen_config,
            opts,
            subs,
            shutdown: Arc::new(Shutdown::default()),
            streams: Vec::new(),
        })
    }
}

/// The tokens that stop the tasks, in the order shutdown cancels them.
#[derive(Debug, Default)]
struct Tokens {
    /// The acker writes what is queued and ends.
    acker: CancellationToken,
    /// The shutdown deadline: the acker cancels its statement and gives up the rest.
    deadline: CancellationToken,
    /// The listener and the maintenance task end.
    background: CancellationToken,
}

/// The bus's tasks; dropping them aborts them.
#[derive(Debug)]
struct Tasks {
    dispatcher: Option<AbortOnDropHandle<()>>,
    acker: Option<AbortOnDropHandle<()>>,
    maintenance: Option<AbortOnDropHandle<()>>,
    listener: Option<AbortOnDropHandle<()>>,
}

/// A running bus. [`shutdown`](RunningBus::shutdown) stops it gracefully; dropping it
/// aborts its tasks (deliveries in flight then come back when their leases expire).
pub struct RunningBus {
    parts: Parts,
    opts: Options,
    streams: Vec<StreamRx>,
    tokens: Tokens,
    tasks: Tasks,
}

impl std::fmt::Debug for RunningBus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunningBus")
            .field("worker_id", &self.parts.consumer.worker)
            .finish_non_exhaustive()
    }
}

impl RunningBus {
    /// The counters so far.
    pub fn stats(&self) -> Stats {
        self.parts.stats.snapshot()
    }

    /// This bus's worker id: `locked_by` of the deliveries it holds, and its row in
    /// `pgbus.consumers`.
    pub fn worker_id(&self) -> &str {
        &self.parts.consumer.worker
    }

    /// Whether the listener is connected and LISTENing now.
    pub fn is_listening(&self) -> bool {
        self.parts.listening.load(Ordering::Acquire)
    }

    /// Whether this bus leads the maintenance now: of all the buses on a database, one
    /// at a time reaps expired leases, repairs ordering keys, sweeps the log and samples
    /// the backlog gauges (see [`BusBuilder::leader_lease`]).
    pub fn is_leader(&self) -> bool {
        self.parts.leads.load(Ordering::Acquire)
    }

    /// This bus's subscriptions that an operator dropped while it runs (checked with the
    /// consumer heartbeat, every 1.25 leader leases: 75 s by default): they receive nothing until registered again
    /// (restarting the bus does that). Each drop is also logged at error level.
    pub fn dropped_subscriptions(&self) -> Vec<String> {
        self.parts
            .dropped
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Makes the claimer look for work now.
    pub fn wake(&self) {
        self.parts.wake.now();
    }

    /// Stops gracefully, all within the shutdown timeout
    /// ([`BusBuilder::shutdown_timeout`]):
    ///
    /// 1. stops claiming, and cancels a reaping, repair or sweep statement in flight;
    ///    releases claimed deliveries that have not started (back to pending, attempt not
    ///    consumed);
    /// 2. waits for running handlers and for the deliveries the application holds from
    ///    its subscription streams, until the timeout less a reserve for step 3 (a
    ///    quarter of it, at most one second); handlers still running then are aborted
    ///    and count as failed attempts;
    /// 3. writes every pending settlement; at the deadline, the statement in flight is
    ///    cancelled and what is left is given up (those leases expire and the deliveries
    ///    return);
    /// 4. ends the listener and the maintenance task, and removes the bus from
    ///    `pgbus.consumers` if time is left (else its row expires).
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`] if settlements were given up at the deadline; the bus is stopped
    /// regardless.
    pub async fn shutdown(mut self) -> Result<()> {
        let (deadline, handlers_deadline) = self.parts.shutdown.begin(self.opts.shutdown_timeout);
        // Release what the streams have buffered but not handed out, before and after
        // the dispatcher ends: a claim under way when stopping began still hands its
        // deliveries over (the dispatcher releases those it gets for streams then).
        self.release_buffered();
        if let Some(mut dispatcher) = self.tasks.dispatcher.take() {
            tokio::select! {
                _ = &mut dispatcher => {}
                _ = tokio::time::sleep_until(handlers_deadline) => {
                    // A claim blocked in the database: cancel it.
                    self.parts.shutdown.overdue().cancel();
                    finish(Some(dispatcher), handlers_deadline).await;
                }
            }
        }
        self.release_buffered();
        self.wait_for_streams(handlers_deadline).await;
        let result = self.settle_by(deadline).await;
        self.tokens.background.cancel();
        for task in [self.tasks.maintenance.take(), self.tasks.listener.take()] {
            finish(task, deadline).await;
        }
        match tokio::time::timeout_at(deadline, self.parts.consumer.remove()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::debug!(error = %e, "pgbus could not remove its consumer row"),
            Err(_) => tracing::debug!("pgbus left its consumer row to expire: no time left"),
        }
        self.parts.consumer.db.close();
        tracing::info!(worker = %self.parts.consumer.worker, "pgbus stopped");
        result
    }

    /// Waits, until `until`, for the deliveries the application holds from its
    /// subscription streams to be settled.
    async fn wait_for_streams(&self, until: tokio::time::Instant) {
        while self.parts.slots.taken() > 0 && tokio::time::Instant::now() < until {
            let _ = tokio::time::timeout_at(until, self.parts.slots.freed()).await;
        }
    }

    /// Lets the acker write what is queued; at `deadline`, makes it give up the rest.
    async fn settle_by(&mut self, deadline: tokio::time::Instant) -> Result<()> {
        self.tokens.acker.cancel();
        let Some(mut acker) = self.tasks.acker.take() else {
            return Ok(());
        };
        tokio::select! {
            _ = &mut acker => Ok(()),
            _ = tokio::time::sleep_until(deadline) => {
                self.tokens.deadline.cancel();
                // It cancels its statement and ends; a server that cannot even be
                // reached for the cancel request is not waited for long.
                let _ = tokio::time::timeout(CANCEL_GRACE, acker).await;
                Err(Error::Timeout("writing the last settlements"))
            }
        }
    }

    fn release_buffered(&self) {
        for rx in &self.streams {
            let mut rx = rx.lock().unwrap_or_else(|p| p.into_inner());
            while rx.try_recv().is_ok() {}
        }
    }
}

/// How long a task stopped at the deadline may take to cancel its statement and end.
const CANCEL_GRACE: Duration = Duration::from_secs(1);

/// Waits for a task that was told to end, until `deadline` (or briefly past it, for one
/// that cancels a statement); then aborts it.
async fn finish(task: Option<AbortOnDropHandle<()>>, deadline: tokio::time::Instant) {
    if let Some(task) = task {
        let until = deadline.max(tokio::time::Instant::now()) + CANCEL_GRACE;
        let _ = tokio::time::timeout_at(until, task).await;
    }
}

/// What a subscription of this bus asks for: its patterns (none: follow the stored
/// ones), and the maximum attempts, ordering and dead-head policy it set explicitly.
fn asked_settings(
    name: &str,
    patterns: Vec<String>,
    options: &SubscriptionOptions,
    opts: &Options,
) -> Result<crate::subscription::SubscriptionChange> {
    if patterns.is_empty() {
        crate::event::validate_name("subscription name", name)?;
    } else {
        crate::subscription::validate_subscription(name, &patterns)?;
    }
    let retry = options.retry.or(opts.retry_set.then_some(opts.retry));
    Ok(crate::subscription::SubscriptionChange {
        patterns: (!patterns.is_empty()).then_some(patterns),
        max_attempts: retry.and_then(|r| r.attempts_if_set()),
        ordered: options.ordered,
        on_dead: options.on_dead,
    })
}
