//! `pgbus consume`: register a subscription and deliver its events until stopped, to
//! standard output (one JSON line each) or to a command (`--exec`).

use std::pin::Pin;
use std::process::{ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use pgbus::trace_context::{TRACEPARENT, TRACESTATE, TraceParent, check_tracestate};
use pgbus::{
    Bus, DeadHeadPolicy, Delivery, HandlerError, RetryPolicy, Subscription, SubscriptionOptions,
};
use rustix::process::Signal;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::{Child, ChildStderr, ChildStdin};
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

use super::group::{Group, Watchdog};
use super::output::LineWriter;
use super::{AllSignals, Failure, Stop, failed, human_duration, parse_duration, usage};

/// How much of a failed command's standard error becomes the attempt's error.
const STDERR_TAIL_BYTES: usize = 2048;

/// How long a command's standard error is still read after the command exited (a
/// background child may hold it open): what comes later is not read.
const OUTPUT_GRACE: Duration = Duration::from_millis(100);

/// How long the bus waits for the settlements of the commands stopped at the shutdown
/// deadline, beyond their grace period.
const SETTLE_MARGIN: Duration = Duration::from_secs(5);

/// Arguments of `pgbus consume`.
#[derive(Debug, clap::Args)]
#[command(after_help = "\
Examples:
  pgbus consume --subscription audit --pattern 'order.*'
  pgbus consume -s mailer -p order.placed -p order.cancelled --exec './send-mail.sh'
  pgbus consume -s search -p '*' --exec 'curl -sf -d @- http://search/index' --concurrency 8
  pgbus consume -s audit -p 'order.*' --metrics-addr 127.0.0.1:9187

Without --exec, each delivery is printed as one JSON line on standard output and acked
once the line is written and flushed:
  {\"subscription\":\"audit\",\"id\":\"0197...\",\"name\":\"order.placed\",\"attempt\":1,
   \"aggregate\":{\"type\":\"order\",\"id\":\"42\"},\"correlation_id\":null,
   \"occurred_at\":\"2025-...Z\",\"headers\":{},\"payload\":{\"order_id\":42}}

With --exec CMD, CMD runs under `sh -c` for each delivery with that JSON on standard
input and PGBUS_SUBSCRIPTION, PGBUS_EVENT_ID, PGBUS_EVENT_NAME and PGBUS_ATTEMPT in its
environment, and TRACEPARENT (and TRACESTATE) when the event carries a trace context (the
headers traceparent and tracestate, as `pgbus publish` writes them): exit 0 acks; any
other exit is a failed attempt whose error is the end of the command's standard error,
retried with exponential backoff until --max-attempts, then a dead letter (see `pgbus
dead`). The exit status alone decides: standard error still open when the command exits
(a background child holds it) is read for 100ms more, then dropped. CMD runs in a
process group of its own; whatever of the group still runs once CMD exited (background
children) is stopped: SIGTERM, then SIGKILL after --kill-grace. A command past --timeout
is stopped the same way and its attempt fails. A failed attempt is recorded only once
nothing of its group runs: its retry never runs next to it.

CMD gets no database credentials: DATABASE_URL, PGBUS_LISTEN_URL and every PG* variable
are removed from its environment, unless --exec-database-env is given (then it gets them,
with DATABASE_URL set to the database pgbus uses).

SIGINT, SIGTERM or SIGHUP (and any other signal that would end pgbus, but SIGQUIT and
SIGKILL) stops it gracefully: nothing more is claimed, deliveries in progress finish (up
to --shutdown-timeout), the rest are released for another consumer. At the deadline (or
at a second signal) the commands still running get SIGTERM, then SIGKILL after
--kill-grace, each to its whole process group: a command that exits 0 meanwhile is
acked, any other end is a failed attempt. SIGQUIT (or SIGABRT) stops it at once: the
commands get SIGTERM, then SIGKILL after --kill-grace, their attempts are recorded, the
rest released, and pgbus exits with 131 (134). Nothing pgbus started runs on after it
exits, even if it is killed with SIGKILL: a watchdog process then kills the commands'
process groups.

Its own output failing is pgbus's failure, not the events': standard output closed (the
reader went away), failing (a full disk), or taking no line for --output-timeout (a
reader that stopped reading) stops the consumer gracefully with exit 1, and the
deliveries not printed go back to the subscription (one at most, the line being
printed, is recorded as a failed attempt retried at once).

Exit codes: 0 stopped by a signal; 1 a failure (the database, the output); 2 bad usage;
131 (134) stopped at once by SIGQUIT (SIGABRT).")]
pub(crate) struct ConsumeArgs {
    /// The subscription's name: created at start if new; an existing one is joined with
    /// its stored settings.
    #[arg(long, short)]
    subscription: String,
    /// An event-name pattern: order.placed, order.* or * (repeatable). Required for a new
    /// subscription; for an existing one, must match the stored patterns.
    #[arg(long = "pattern", short)]
    patterns: Vec<String>,
    /// Run this shell command for each delivery instead of printing it.
    #[arg(long, value_name = "CMD")]
    exec: Option<String>,
    /// Pass the database's connection settings on to the --exec commands: DATABASE_URL
    /// (the database pgbus uses), PGBUS_LISTEN_URL and the PG* variables (PGPASSWORD...).
    /// Without it they are removed from the commands' environment.
    #[arg(long, requires = "exec")]
    exec_database_env: bool,
    /// How many deliveries are handled at once.
    #[arg(long, default_value_t = pgbus::DEFAULT_CONCURRENCY)]
    concurrency: usize,
    /// Attempts before a delivery becomes a dead letter (default: the stored value, 25
    /// for a new subscription).
    #[arg(long)]
    max_attempts: Option<i32>,
    /// The first retry delay; it doubles with each attempt (with jitter, up to 1h).
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    retry_base: Duration,
    /// How long a claimed delivery stays with this consumer without a heartbeat: a
    /// crashed consumer's deliveries come back after it.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    lease: Duration,
    /// Kill a --exec command that runs longer than this (a failed attempt).
    #[arg(long, value_parser = parse_duration)]
    timeout: Option<Duration>,
    /// Look for work this often while the listener is down (or with --poll-only).
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    poll_interval: Duration,
    /// Look for work at least this often while the listener is connected (it hears every
    /// commit that makes work; scheduled and retried deliveries are claimed when due).
    #[arg(long, default_value = "5m", value_parser = parse_duration)]
    idle_poll_interval: Duration,
    /// How long the maintenance leadership lasts without renewal: one consumer at a
    /// time reaps expired leases, repairs ordering keys and sweeps the log; a leader that
    /// dies is replaced within 2.25 times this.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    leader_lease: Duration,
    /// Do not LISTEN; find work by polling only.
    #[arg(long, conflicts_with = "listen_url")]
    poll_only: bool,
    /// LISTEN through this connection instead (e.g. a direct one, when DATABASE_URL
    /// goes through a transaction-mode pooler). A password in it is refused: give the URL
    /// in PGBUS_LISTEN_URL, or the password in the password file.
    #[arg(
        long,
        value_name = "URL",
        env = "PGBUS_LISTEN_URL",
        hide_env_values = true
    )]
    listen_url: Option<String>,
    /// DATABASE_URL goes through a transaction-mode pooler (PgBouncer): the bus keeps its
    /// settings and statements within each transaction, and LISTENs only through
    /// --listen-url (without one it polls, and says so).
    #[arg(long, env = "PGBUS_POOLER")]
    pooler: bool,
    /// How long a graceful stop waits for deliveries in progress.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    shutdown_timeout: Duration,
    /// How long a --exec command's process group has, after SIGTERM, before SIGKILL (at
    /// --timeout, at the shutdown deadline, at SIGQUIT, and for what it left running after
    /// it exited).
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    kill_grace: Duration,
    /// Stop (exit 1) when standard output takes no line for this long: nobody reads it
    /// [default: --lease].
    #[arg(long, value_parser = parse_duration)]
    output_timeout: Option<Duration>,
    /// Deliver each ordering key's events one at a time, in the order they committed
    /// (the key: the event's ordering key, else its aggregate "type:id"). Default: the
    /// stored setting (unordered for a new subscription).
    #[arg(long, conflicts_with = "unordered")]
    ordered: bool,
    /// Deliver events in any order (see --ordered).
    #[arg(long)]
    unordered: bool,
    /// What a key's dead head does in an ordered subscription (block the key, or skip the
    /// head). Default: the stored setting (block for a new subscription).
    #[arg(long, value_enum)]
    on_dead: Option<OnDead>,
    /// Change the subscription's stored settings to the ones given here, for every
    /// consumer (as `pgbus subscriptions set` does). Without it, settings that differ from
    /// the stored ones make consume refuse to start.
    #[arg(long)]
    reconfigure: bool,
    /// Serve Prometheus metrics at http://IP:PORT/metrics (e.g. 127.0.0.1:9187): the
    /// delivery counters and histograms, and the subscription's backlog gauges, sampled
    /// every 15s (see `pgbus metrics --help`).
    #[arg(long, value_name = "IP:PORT", value_parser = super::metrics::parse_addr)]
    metrics_addr: Option<std::net::SocketAddr>,
}

/// `--on-dead`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum OnDead {
    /// The key stops until `pgbus keys redrive` or `pgbus keys skip`.
    Block,
    /// The dead head is set aside (listed by `pgbus dead list`) and the key goes on.
    Skip,
}

impl OnDead {
    pub(crate) fn policy(self) -> DeadHeadPolicy {
        match self {
            OnDead::Block => DeadHeadPolicy::Block,
            OnDead::Skip => DeadHeadPolicy::Skip,
        }
    }
}

/// What the consumer did, reported when it stops.
#[derive(Debug, Default)]
struct Counts {
    acked: AtomicU64,
    failed: AtomicU64,
    released: AtomicU64,
}

/// How deliveries are handled.
#[derive(Debug)]
enum Sink {
    /// Standard output, one line at a time from a thread of its own: a slow reader slows
    /// the consumer (the backpressure wanted), a reader that takes nothing for `timeout`
    /// stops it.
    Stdout {
        writer: LineWriter,
        timeout: Duration,
    },
    Exec {
        command: String,
        timeout: Option<Duration>,
        /// Kills the commands' groups should pgbus die.
        watchdog: Option<Arc<Watchdog>>,
        /// `--exec-database-env`: the URL to give as DATABASE_URL; `None`: no database
        /// settings at all.
        database_env: Option<Option<String>>,
        /// The variables removed from the commands' environment.
        removed_env: Vec<std::ffi::OsString>,
    },
}

/// What the deliveries in progress share.
#[derive(Debug)]
struct Ctx {
    sink: Sink,
    kill_grace: Duration,
    counts: Counts,
    /// Cancelled to stop gracefully: by a signal, or by a failure of the output.
    stop: CancellationToken,
    /// Cancelled at the shutdown deadline (or a second signal): commands still running
    /// are stopped, lines not yet printed are given back.
    deadline: CancellationToken,
    /// The output failure that stopped the consumer: its exit.
    output_failure: Mutex<Option<Failure>>,
    /// The exit code asked for by a signal that stops the consumer at once.
    immediate_exit: Mutex<Option<u8>>,
}

impl Ctx {
    /// Records why the consumer must stop with a failure (its own output failed, its
    /// subscription was dropped) and stops it.
    fn output_failed(&self, failure: Failure) {
        let mut slot = self
            .output_failure
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if slot.is_none() {
            *slot = Some(failure);
        }
        self.stop.cancel();
    }
}

pub(crate) async fn run(args: ConsumeArgs, url: Option<&str>) -> Result<(), Failure> {
    let config = super::database_config(url)?.pooler(args.pooler);
    if args.max_attempts.is_some_and(|n| n < 1) {
        return Err(usage("error: --max-attempts must be at least 1"));
    }
    let mut retry = RetryPolicy::exponential(args.retry_base);
    if let Some(n) = args.max_attempts {
        retry = retry.max_attempts(n);
    }
    // The bus waits past our deadline for the settlements of the commands stopped there.
    let mut builder = Bus::builder(config)
        .concurrency(args.concurrency)
        .lease(args.lease)
        .poll_interval(args.poll_interval)
        .idle_poll_interval(args.idle_poll_interval)
        .leader_lease(args.leader_lease)
        .poll_only(args.poll_only)
        .shutdown_timeout(args.shutdown_timeout + args.kill_grace + SETTLE_MARGIN)
        .reconfigure(args.reconfigure)
        .retry(retry);
    // Without an exporter the gauges would be sampled for nobody.
    if args.metrics_addr.is_none() {
        builder = builder.gauge_interval(None);
    }
    if let Some(listen_url) = &args.listen_url {
        let listen = super::database_config(Some(listen_url))
            .map_err(|f| usage(f.message.replace("DATABASE_URL", "--listen-url")))?;
        builder = builder.listen_config(listen);
    }
    let mut bus = builder.build()?;
    let mut options = SubscriptionOptions::new();
    if args.ordered || args.unordered {
        options = options.ordered(args.ordered);
    }
    if let Some(on_dead) = args.on_dead {
        options = options.on_dead(on_dead.policy());
    }
    let subscription = bus.subscribe_with(&args.subscription, args.patterns.clone(), options)?;
    let sink = match args.exec {
        Some(command) => Sink::Exec {
            command,
            timeout: args.timeout,
            watchdog: Some(Watchdog::start().map_err(|e| {
                failed(format!(
                    "error: cannot start the watchdog of the commands (sh): {e}"
                ))
            })?),
            database_env: args.exec_database_env.then(|| url.map(str::to_string)),
            removed_env: credential_variables(std::env::vars_os().map(|(k, _)| k)),
        },
        None => Sink::Stdout {
            writer: LineWriter::start()
                .map_err(|e| failed(format!("error: cannot start the output thread: {e}")))?,
            timeout: args.output_timeout.unwrap_or(args.lease),
        },
    };
    if let Some(addr) = args.metrics_addr {
        super::metrics::serve(addr)?;
    }
    let running = bus.start().await?;
    let ctx = Arc::new(Ctx {
        sink,
        kill_grace: args.kill_grace,
        counts: Counts::default(),
        stop: CancellationToken::new(),
        deadline: CancellationToken::new(),
        output_failure: Mutex::new(None),
        immediate_exit: Mutex::new(None),
    });
    // Signals are watched on a task of their own that does nothing else: no write, however
    // blocked, can keep it from stopping the consumer.
    let mut signals = AllSignals::catch()?;
    let _watch = AbortOnDropHandle::new(tokio::spawn({
        let ctx = ctx.clone();
        async move {
            loop {
                match signals.recv().await {
                    Stop::Graceful(_) if !ctx.stop.is_cancelled() => ctx.stop.cancel(),
                    Stop::Graceful(_) => ctx.deadline.cancel(),
                    Stop::Immediate(name, code) => {
                        *ctx.immediate_exit.lock().unwrap_or_else(|p| p.into_inner()) = Some(code);
                        eprintln!(
                            "pgbus: {name}: stopping at once (commands still running get \
                             SIGTERM, then SIGKILL after {})",
                            human_duration(ctx.kill_grace)
                        );
                        ctx.stop.cancel();
                        ctx.deadline.cancel();
                    }
                }
            }
        }
    }));
    eprintln!(
        "pgbus: consuming {:?} ({}) as worker {}; stop with Ctrl-C or SIGTERM",
        args.subscription,
        if args.patterns.is_empty() {
            "its stored patterns".to_string()
        } else {
            args.patterns.join(", ")
        },
        running.worker_id()
    );

    let mut work: Pin<Box<dyn Future<Output = ()> + Send>> = match &ctx.sink {
        Sink::Stdout { .. } => Box::pin(print_deliveries(subscription, ctx.clone())),
        Sink::Exec { .. } => {
            let ctx = ctx.clone();
            Box::pin(
                subscription.for_each_concurrent(args.concurrency, move |delivery| {
                    let ctx = ctx.clone();
                    async move { exec_delivery(&ctx, delivery).await }
                }),
            )
        }
    };
    let mut work_done = false;
    // A subscription dropped by an operator under a running consumer: stop, loudly,
    // instead of idling on nothing.
    let dropped = async {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tick.tick().await;
            if let Some(name) = running.dropped_subscriptions().first() {
                return failed(format!(
                    "error: subscription {name:?} was dropped while this consumer ran; \
                     stopping (start it again to register it anew)"
                ));
            }
        }
    };
    tokio::select! {
        () = &mut work => work_done = true,
        () = ctx.stop.cancelled() => {}
        failure = dropped => ctx.output_failed(failure),
    }
    eprintln!("pgbus: stopping: finishing deliveries in progress");
    // Keep handling what was handed out while the bus drains; at the deadline the
    // commands still running are stopped and their attempts settled.
    let deadline = tokio::time::Instant::now() + args.shutdown_timeout;
    let shutdown = running.shutdown();
    tokio::pin!(shutdown);
    let stopped = loop {
        tokio::select! {
            // First: its first poll stops the claiming before the work hands out more.
            biased;
            r = &mut shutdown => break r,
            () = &mut work, if !work_done => work_done = true,
            () = tokio::time::sleep_until(deadline), if !ctx.deadline.is_cancelled() => {
                ctx.deadline.cancel();
            }
        }
    };
    // Whatever is still running cannot be settled any more: dropping it kills its
    // command's process group at once (its lease brings the delivery back).
    drop(work);
    if let Sink::Exec {
        watchdog: Some(watchdog),
        ..
    } = &ctx.sink
    {
        watchdog.stop().await;
    }
    stopped?;
    eprintln!(
        "pgbus: stopped: {} acked, {} failed attempts, {} given back",
        ctx.counts.acked.load(Ordering::Relaxed),
        ctx.counts.failed.load(Ordering::Relaxed),
        ctx.counts.released.load(Ordering::Relaxed),
    );
    let failure = ctx
        .output_failure
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .take();
    if let Some(failure) = failure {
        return Err(failure);
    }
    match *ctx.immediate_exit.lock().unwrap_or_else(|p| p.into_inner()) {
        Some(code) => Err(Failure {
            message: String::new(),
            code,
        }),
        None => Ok(()),
    }
}

/// The variables of pgbus's environment that carry the database's connection settings
/// (credentials among them): DATABASE_URL and every PG* variable (PGPASSWORD,
/// PGBUS_LISTEN_URL...). The --exec commands do not get them.
fn credential_variables(
    names: impl Iterator<Item = std::ffi::OsString>,
) -> Vec<std::ffi::OsString> {
    names
        .filter(|name| {
            let name = name.as_encoded_bytes();
            name == b"DATABASE_URL" || name.starts_with(b"PG")
        })
        .collect()
}

/// The JSON form of a delivery: one line on standard output, or a command's input.
fn delivery_json(delivery: &Delivery) -> String {
    let e = delivery.event();
    let aggregate = match (&e.aggregate_type, &e.aggregate_id) {
        (Some(kind), Some(id)) => json!({"type": kind, "id": id}),
        _ => serde_json::Value::Null,
    };
    json!({
        "subscription": delivery.subscription(),
        "id": e.id,
        "name": e.name,
        "attempt": delivery.attempt(),
        "aggregate": aggregate,
        "correlation_id": e.correlation_id,
        "causation_id": e.causation_id,
        "source": e.source,
        "version": e.version,
        "occurred_at": e.occurred_at,
        "headers": e.headers,
        "payload": e.payload,
    })
    .to_string()
}

/// Prints the deliveries one at a time, each acked once its line is written: only the
/// delivery being printed is exposed to a failure of the output. Acks are written in the
/// background while the next line is printed.
async fn print_deliveries(mut subscription: Subscription, ctx: Arc<Ctx>) {
    let Sink::Stdout { writer, timeout } = &ctx.sink else {
        return;
    };
    let mut acks = FuturesUnordered::new();
    loop {
        let delivery = tokio::select! {
            Some(()) = acks.next(), if !acks.is_empty() => continue,
            next = subscription.next() => match next {
                Some(delivery) => delivery,
                None => break,
            },
        };
        let line = delivery_json(&delivery);
        let written = tokio::select! {
            r = writer.write(line) => r.map_err(|e| {
                if super::output::is_closed(&e) {
                    failed("error: standard output was closed (its reader went away)")
                } else {
                    failed(format!("error: could not write to standard output: {e}"))
                }
            }),
            () = tokio::time::sleep(*timeout) => Err(failed(format!(
                "error: standard output took no line for {} (is anything reading it?)",
                human_duration(*timeout)
            ))),
            () = ctx.deadline.cancelled() => {
                give_back(&ctx, delivery, "pgbus stopped before printing it").await;
                break;
            }
        };
        match written {
            Ok(()) => acks.push(ack(&ctx, delivery)),
            Err(failure) => {
                ctx.output_failed(failure);
                give_back(&ctx, delivery, "pgbus could not print it").await;
                break;
            }
        }
    }
    // What the bus hands out from now on is not printed (it is stopping; until then it
    // may still hand out one more): the stream ends once its buffer is released.
    while let Some(delivery) = subscription.next().await {
        give_back(&ctx, delivery, "pgbus stopped before printing it").await;
    }
    while acks.next().await.is_some() {}
}

/// Runs the command for one delivery, settles it by the command's exit status, then ends
/// what the command left running.
async fn exec_delivery(ctx: &Ctx, delivery: Delivery) {
    let Sink::Exec {
        command, timeout, ..
    } = &ctx.sink
    else {
        return;
    };
    let line = delivery_json(&delivery);
    let (result, group) = run_command(ctx, command, *timeout, &delivery, &line).await;
    match result {
        Ok(()) => {
            ack(ctx, delivery).await;
            if let Some(mut group) = group {
                end_group(ctx, &mut group).await;
            }
        }
        Err(error) => {
            // Recorded only once nothing of the command runs: its retry (here or in
            // another consumer) never runs next to it.
            if let Some(mut group) = group {
                end_group(ctx, &mut group).await;
            }
            fail(ctx, delivery, error).await;
        }
    }
}

/// Ends what is left of a command's group: SIGTERM, --kill-grace, SIGKILL; from the
/// deadline on, SIGKILL at once. Returns once nothing of it runs.
async fn end_group(ctx: &Ctx, group: &mut Group) {
    let at_deadline = tokio::select! {
        () = group.end(ctx.kill_grace) => false,
        () = ctx.deadline.cancelled() => true,
    };
    if at_deadline {
        group.kill().await;
    }
}

/// A delivery's id, as a terminal shows it safely (ids stored before pgbus refused
/// control characters may still hold them), and its attempt.
fn shown(delivery: &Delivery) -> (String, i32) {
    (
        super::visible(&delivery.event().id).into_owned(),
        delivery.attempt(),
    )
}

async fn ack(ctx: &Ctx, delivery: Delivery) {
    let (id, attempt) = shown(&delivery);
    match delivery.ack().await {
        Ok(()) => {
            ctx.counts.acked.fetch_add(1, Ordering::Relaxed);
        }
        Err(e) => eprintln!("pgbus: event {id} attempt {attempt}: could not ack: {e}"),
    }
}

async fn fail(ctx: &Ctx, delivery: Delivery, error: String) {
    let (id, attempt) = shown(&delivery);
    eprintln!(
        "pgbus: event {id} attempt {attempt} failed: {}",
        super::visible(&error)
    );
    match delivery.fail(HandlerError::new(error)).await {
        Ok(()) => {
            ctx.counts.failed.fetch_add(1, Ordering::Relaxed);
        }
        Err(e) => {
            eprintln!("pgbus: event {id} attempt {attempt}: could not record the failure: {e}")
        }
    }
}

/// Gives a delivery back to the subscription because pgbus, not the event, failed: it
/// is pending again at once, its attempt not consumed, no failure recorded.
async fn give_back(ctx: &Ctx, delivery: Delivery, reason: &str) {
    let (id, attempt) = shown(&delivery);
    match delivery.release().await {
        Ok(()) => {
            ctx.counts.released.fetch_add(1, Ordering::Relaxed);
        }
        Err(e) => {
            eprintln!("pgbus: event {id} attempt {attempt} ({reason}): could not give it back: {e}")
        }
    }
}

/// How a command's run ended.
enum End {
    Exited(std::io::Result<ExitStatus>),
    TimedOut(Duration),
    Deadline,
}

/// Runs `command` with the event on standard input. Returns the verdict (an error is
/// what to record) and the command's process group, still to be ended.
async fn run_command(
    ctx: &Ctx,
    command: &str,
    timeout: Option<Duration>,
    delivery: &Delivery,
    input: &str,
) -> (Result<(), String>, Option<Group>) {
    let Sink::Exec {
        watchdog,
        database_env,
        removed_env,
        ..
    } = &ctx.sink
    else {
        return (Err("not a command sink".to_string()), None);
    };
    let event = delivery.event();
    let mut sh = tokio::process::Command::new("sh");
    match database_env {
        None => {
            for name in removed_env {
                sh.env_remove(name);
            }
        }
        Some(Some(url)) => {
            sh.env("DATABASE_URL", url);
        }
        Some(None) => {}
    }
    trace_env(&mut sh, event);
    let spawned = sh
        .arg("-c")
        .arg(command)
        .env("PGBUS_SUBSCRIPTION", delivery.subscription())
        .env("PGBUS_EVENT_ID", &event.id)
        .env("PGBUS_EVENT_NAME", &event.name)
        .env("PGBUS_ATTEMPT", delivery.attempt().to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::inherit())
        .stderr(Stdio::piped())
        // Its own process group: a Ctrl-C at the terminal stops pgbus gracefully and
        // lets the command finish, instead of killing it mid-delivery; and pgbus can
        // signal the command with everything it started.
        .process_group(0)
        .spawn();
    let mut child = match spawned {
        Ok(child) => child,
        Err(e) => return (Err(format!("could not start sh: {e}")), None),
    };
    // From here on, the group is killed if this future is dropped.
    let group = Group::led_by(child.id(), watchdog.clone());
    let stdin = child.stdin.take();
    let mut stderr = child.stderr.take();
    let mut tail = Vec::new();
    let end = {
        let feed = feed(stdin, input);
        let reading = read_tail(stderr.as_mut(), &mut tail);
        let exited = child.wait();
        let limit = async {
            match timeout {
                Some(limit) => {
                    tokio::time::sleep(limit).await;
                    limit
                }
                None => std::future::pending().await,
            }
        };
        tokio::pin!(feed, reading, exited, limit);
        let (mut fed, mut read) = (false, false);
        let end = loop {
            tokio::select! {
                status = &mut exited => break End::Exited(status),
                () = &mut feed, if !fed => fed = true,
                () = &mut reading, if !read => read = true,
                limit = &mut limit => break End::TimedOut(limit),
                () = ctx.deadline.cancelled() => break End::Deadline,
            }
        };
        if matches!(end, End::Exited(_)) && !read {
            // Standard error still open after the exit: a background child holds it.
            let _ = tokio::time::timeout(OUTPUT_GRACE, &mut reading).await;
        }
        end
        // The input not yet written is dropped here, closing the pipe.
    };
    let result = match end {
        End::Exited(status) => verdict(status, &tail),
        End::TimedOut(limit) => {
            stop(&mut child, &group, ctx.kill_grace).await;
            Err(format!("command timed out after {}", human_duration(limit)))
        }
        End::Deadline => match stop(&mut child, &group, ctx.kill_grace).await {
            Some(status) if status.success() => Ok(()),
            Some(status) => Err(format!(
                "command stopped at the shutdown deadline ({status})"
            )),
            None => Err("command killed at the shutdown deadline".to_string()),
        },
    };
    (result, Some(group))
}

/// The event's trace context in the command's environment, as OpenTelemetry's process
/// carriers: `TRACEPARENT` (and `TRACESTATE`) from its headers when it carries a
/// well-formed `traceparent`; never pgbus's own (another trace's).
fn trace_env(sh: &mut tokio::process::Command, event: &pgbus::Event) {
    sh.env_remove("TRACEPARENT").env_remove("TRACESTATE");
    let header = |key: &str| event.headers.get(key).and_then(serde_json::Value::as_str);
    let Some(parent) = header(TRACEPARENT).filter(|p| p.parse::<TraceParent>().is_ok()) else {
        return;
    };
    sh.env("TRACEPARENT", parent);
    if let Some(state) = header(TRACESTATE).filter(|s| check_tracestate(s).is_ok()) {
        sh.env("TRACESTATE", state);
    }
}

/// Writes the event to the command's standard input and closes it.
async fn feed(stdin: Option<ChildStdin>, input: &str) {
    if let Some(mut stdin) = stdin {
        // A command that does not read its input closes the pipe: not an error.
        let _ = stdin.write_all(input.as_bytes()).await;
        let _ = stdin.write_all(b"\n").await;
    }
}

/// Reads the command's standard error to its end, keeping the last bytes in `tail`.
async fn read_tail(stderr: Option<&mut ChildStderr>, tail: &mut Vec<u8>) {
    if let Some(stderr) = stderr {
        let mut buf = [0u8; 4096];
        while let Ok(n @ 1..) = stderr.read(&mut buf).await {
            tail.extend_from_slice(&buf[..n]);
            if tail.len() > STDERR_TAIL_BYTES {
                tail.drain(..tail.len() - STDERR_TAIL_BYTES);
            }
        }
    }
}

/// Stops a command still running: SIGTERM to its group, up to `grace` for the shell to
/// exit, then SIGKILL to the group. Returns the shell's status if it exited by itself.
async fn stop(child: &mut Child, group: &Group, grace: Duration) -> Option<ExitStatus> {
    group.signal(Signal::TERM);
    if let Ok(Ok(status)) = tokio::time::timeout(grace, child.wait()).await {
        return Some(status);
    }
    group.signal(Signal::KILL);
    // SIGKILL cannot be refused: the shell is reaped at once (bounded all the same).
    let _ = tokio::time::timeout(Duration::from_secs(5), child.wait()).await;
    None
}

/// Exit 0 acks; anything else fails the attempt with the end of standard error.
fn verdict(status: std::io::Result<ExitStatus>, tail: &[u8]) -> Result<(), String> {
    let status = status.map_err(|e| format!("could not wait for the command: {e}"))?;
    if status.success() {
        return Ok(());
    }
    let tail = String::from_utf8_lossy(tail);
    let tail = tail.trim();
    Err(if tail.is_empty() {
        format!("command failed ({status})")
    } else {
        format!("command failed ({status}): {tail}")
    })
}
