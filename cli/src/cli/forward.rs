//! `pgbus forward`: relay a subscription into a broker (NATS JetStream), each delivery
//! acknowledged in PostgreSQL only once the broker has stored its event.
//!
//! The relay's core (this file) knows brokers only through [`Sink`] (`sink.rs`): publish
//! one event, answered when the broker has it. The JetStream sink is in `jetstream.rs`;
//! a second broker (Kafka, Redpanda) is another `Sink` and another set of connection
//! options. The command picks the sink; the sinks know nothing of the command.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures::StreamExt;
use pgbus::{Bus, Delivery, RetryPolicy, Subscription, SubscriptionOptions};
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

use super::jetstream::{JetStream, NatsArgs};
use super::sink::{Sink, SinkError, Stored};
use super::{Failure, StopSignals, usage};

/// The first pause after a broker failed to take an event; it doubles up to
/// [`BACKOFF_MAX`].
const BACKOFF_MIN: Duration = Duration::from_millis(100);

/// The longest pause between two tries of the same event.
const BACKOFF_MAX: Duration = Duration::from_secs(5);

/// How often a broker outage is reported while it lasts.
const WARN_EVERY: Duration = Duration::from_secs(10);

/// Arguments of `pgbus forward`.
#[derive(Debug, clap::Args)]
#[command(after_help = "\
Examples:
  nats-server -js &
  pgbus forward --subscription to-nats --pattern '*'
  pgbus forward -s orders-out -p 'order.*' --ordered --nats-url nats://nats-1:4222 \\
      --nats-url nats://nats-2:4222 --nats-creds relay.creds --stream ORDERS

Each event goes to subject <prefix>.<event name> with the payload (JSON) as the body,
Nats-Msg-Id = the event id, and the envelope as headers (Pgbus-Id, Pgbus-Name,
Pgbus-Version, Pgbus-Source, Pgbus-Aggregate-Type, Pgbus-Aggregate-Id,
Pgbus-Ordering-Key (the ordering key, else type:id of the aggregate),
Pgbus-Correlation-Id, Pgbus-Causation-Id, Pgbus-Occurred-At, Pgbus-Seq, Pgbus-Headers:
the event's headers as JSON; each string header such as traceparent also as itself,
unless NATS cannot carry it, which a warning names).
The delivery is acknowledged in PostgreSQL only after JetStream's PubAck. Unordered
subscriptions have up to --concurrency publishes in flight; ordered ones one per key.

--stream is created if missing (subjects <prefix>.>, file storage, duplicate window the
larger of 2m and twice --lease) or verified if present: its subjects must cover
<prefix>.>, its duplicate window must be at least --lease, and it must acknowledge
publishes. A stream that does not fit stops the forwarder at start with exit 2.

NATS unreachable or restarting: each event is tried again with a backoff (up to 5s)
while its delivery stays leased; nothing is lost, and a re-sent event is dropped by
JetStream's duplicate window (Nats-Msg-Id).

An event NATS refuses (a subject the user may not publish to, larger than the stream's
max_msg_size or the server's max_payload) becomes a dead letter with the broker's reason.
Credentials NATS refuses (at start or later) stop the forwarder with exit 1.

Exit codes: 0 stopped by a signal; 1 a failure; 2 bad usage or a stream that does not fit.")]
pub(crate) struct ForwardArgs {
    /// The subscription's name: created at start if new; an existing one is joined with
    /// its stored settings.
    #[arg(long, short)]
    subscription: String,
    /// An event-name pattern: order.placed, order.* or * (repeatable). Required for a new
    /// subscription.
    #[arg(long = "pattern", short)]
    patterns: Vec<String>,
    #[command(flatten)]
    nats: NatsArgs,
    /// The JetStream stream: created if missing, verified if present.
    #[arg(long, default_value = "PGBUS")]
    stream: String,
    /// Subjects are <prefix>.<event name>.
    #[arg(long, default_value = "pgbus")]
    subject_prefix: String,
    /// How many publishes are in flight at once (an ordered subscription: at most one per
    /// key).
    #[arg(long, default_value_t = 256)]
    concurrency: usize,
    /// How many deliveries one claim takes at most.
    #[arg(long, default_value_t = pgbus::DEFAULT_BATCH_SIZE)]
    batch: usize,
    /// How long a claimed delivery stays with this forwarder without a heartbeat: a
    /// crashed forwarder's deliveries come back after it.
    #[arg(long, default_value = "60s", value_parser = super::parse_duration)]
    lease: Duration,
    /// Look for work at least this often, whatever the notifications.
    #[arg(long, default_value = "1s", value_parser = super::parse_duration)]
    poll_interval: Duration,
    /// How long a graceful stop waits for publishes in flight.
    #[arg(long, default_value = "30s", value_parser = super::parse_duration)]
    shutdown_timeout: Duration,
    /// Forward each ordering key's events one at a time, in the order they committed.
    /// Default: the stored setting (unordered for a new subscription).
    #[arg(long, conflicts_with = "unordered")]
    ordered: bool,
    /// Forward events in any order (see --ordered).
    #[arg(long)]
    unordered: bool,
    /// Change the subscription's stored settings to the ones given here.
    #[arg(long)]
    reconfigure: bool,
}

/// What the forwarder did, reported when it stops.
#[derive(Debug, Default)]
pub(crate) struct Counts {
    /// Events the broker stored.
    pub(crate) forwarded: AtomicU64,
    duplicates: AtomicU64,
    retried: AtomicU64,
    rejected: AtomicU64,
}

/// Forwards the deliveries of `subscription` into `sink`, up to `concurrency` at once,
/// until the subscription ends (the bus stops) or `stop` is cancelled.
pub(crate) async fn forward(
    subscription: Subscription,
    sink: Arc<dyn Sink>,
    concurrency: usize,
    stop: CancellationToken,
    counts: Arc<Counts>,
) {
    let warned = std::sync::Mutex::new(None::<tokio::time::Instant>);
    subscription
        .for_each_concurrent(concurrency, |delivery| {
            forward_one(delivery, &*sink, &stop, &counts, &warned)
        })
        .await;
}

/// Publishes one delivery's event until the sink takes it, then acknowledges it. A
/// broker that is unavailable is tried again after a growing pause; the delivery stays
/// leased meanwhile (the bus extends its lease), so an ordered key waits in place.
async fn forward_one(
    delivery: Delivery,
    sink: &dyn Sink,
    stop: &CancellationToken,
    counts: &Counts,
    warned: &std::sync::Mutex<Option<tokio::time::Instant>>,
) {
    let mut pause = BACKOFF_MIN;
    loop {
        match sink.publish(delivery.event()).await {
            Ok(stored) => {
                let counter = match stored {
                    Stored::New => &counts.forwarded,
                    Stored::Duplicate => &counts.duplicates,
                };
                counter.fetch_add(1, Ordering::Relaxed);
                if let Err(e) = delivery.ack().await {
                    // The event is in the broker; its delivery comes back and the re-send
                    // is dropped as a duplicate.
                    pgbus::warn_limited!(error = %e, "acknowledging a forwarded delivery failed");
                }
                return;
            }
            Err(SinkError::Rejected(reason)) => {
                counts.rejected.fetch_add(1, Ordering::Relaxed);
                let id = delivery.event().id.clone();
                tracing::error!(event = %id, %reason, "the broker refuses the event");
                if let Err(e) = delivery.dead_letter(reason).await {
                    pgbus::warn_limited!(error = %e, "dead-lettering a refused delivery failed");
                }
                return;
            }
            Err(SinkError::Unavailable(reason)) => {
                counts.retried.fetch_add(1, Ordering::Relaxed);
                {
                    let mut last = warned.lock().unwrap_or_else(|p| p.into_inner());
                    let now = tokio::time::Instant::now();
                    if last.is_none_or(|at| now.duration_since(at) >= WARN_EVERY) {
                        *last = Some(now);
                        eprintln!("pgbus: the broker did not take an event ({reason}); retrying");
                    }
                }
                let jittered = pause.mul_f64(0.5 + fastrand::f64() * 0.5);
                tokio::select! {
                    () = tokio::time::sleep(jittered) => {}
                    () = stop.cancelled() => {
                        // Stopping: give it back unused for the next forwarder.
                        let _ = delivery.release().await;
                        return;
                    }
                }
                pause = (pause * 2).min(BACKOFF_MAX);
            }
        }
    }
}

pub(crate) async fn run(args: ForwardArgs, url: Option<&str>) -> Result<(), Failure> {
    let config = super::database_config(url)?;
    if args.concurrency == 0 {
        return Err(usage("error: --concurrency must be at least 1"));
    }
    if args.batch == 0 {
        return Err(usage("error: --batch must be at least 1"));
    }
    super::jetstream::check_prefix(&args.subject_prefix)?;
    let sink =
        JetStream::connect(&args.nats, &args.stream, &args.subject_prefix, args.lease).await?;
    let mut bus = Bus::builder(config)
        .concurrency(args.concurrency)
        .batch_size(args.batch)
        .lease(args.lease)
        .poll_interval(args.poll_interval)
        .shutdown_timeout(args.shutdown_timeout)
        .reconfigure(args.reconfigure)
        .retry(RetryPolicy::exponential(Duration::from_secs(1)))
        .build()?;
    let mut options = SubscriptionOptions::new();
    if args.ordered || args.unordered {
        options = options.ordered(args.ordered);
    }
    let subscription = bus.subscribe_with(&args.subscription, args.patterns.clone(), options)?;
    let running = bus.start().await?;
    let stop = CancellationToken::new();
    let mut signals = StopSignals::catch()?;
    let _watch = AbortOnDropHandle::new(tokio::spawn({
        let stop = stop.clone();
        async move {
            signals.recv().await;
            stop.cancel();
        }
    }));
    eprintln!(
        "pgbus: forwarding {:?} to JetStream stream {:?} (subjects {}.>) as worker {}; \
         stop with Ctrl-C or SIGTERM",
        args.subscription,
        args.stream,
        args.subject_prefix,
        running.worker_id()
    );
    let counts = Arc::new(Counts::default());
    let refused = sink.refused();
    tokio::pin!(refused);
    let mut refusal = None;
    let work = forward(
        subscription,
        Arc::new(sink),
        args.concurrency,
        stop.clone(),
        counts.clone(),
    );
    tokio::pin!(work);
    let work_done = tokio::select! {
        () = &mut work => true,
        () = stop.cancelled() => false,
        reason = &mut refused => {
            refusal = Some(reason);
            false
        }
    };
    eprintln!("pgbus: stopping: finishing publishes in flight");
    stop.cancel();
    // The shutdown is polled first: it stops the claiming before the work takes more.
    let (stopped, ()) = futures::join!(running.shutdown(), async {
        if !work_done {
            work.await;
        }
    });
    stopped?;
    eprintln!(
        "pgbus: stopped: {} forwarded, {} already in the stream (re-sent), {} tries the \
         broker did not take, {} refused",
        counts.forwarded.load(Ordering::Relaxed),
        counts.duplicates.load(Ordering::Relaxed),
        counts.retried.load(Ordering::Relaxed),
        counts.rejected.load(Ordering::Relaxed),
    );
    match refusal {
        Some(reason) => Err(super::failed(super::jetstream::refused_text(&reason))),
        None => Ok(()),
    }
}
