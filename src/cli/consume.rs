//! `pgbus consume`: register a subscription and deliver its events until stopped, to
//! standard output (one JSON line each) or to a command (`--exec`).

use std::io::Write as _;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures::StreamExt;
use pgbus::{Bus, DeadHeadPolicy, Delivery, HandlerError, RetryPolicy, SubscriptionOptions};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

use super::{Failure, failed, parse_duration, usage};

/// How much of a failed command's standard error becomes the attempt's error.
const STDERR_TAIL_BYTES: usize = 2048;

/// Arguments of `pgbus consume`.
#[derive(Debug, clap::Args)]
#[command(after_help = "\
Examples:
  pgbus consume --subscription audit --pattern 'order.*'
  pgbus consume -s mailer -p order.placed -p order.cancelled --exec './send-mail.sh'
  pgbus consume -s search -p '*' --exec 'curl -sf -d @- http://search/index' --concurrency 8

Without --exec, each delivery is printed as one JSON line on standard output and acked
once the line is written and flushed:
  {\"subscription\":\"audit\",\"id\":\"0197...\",\"name\":\"order.placed\",\"attempt\":1,
   \"aggregate\":{\"type\":\"order\",\"id\":\"42\"},\"correlation_id\":null,
   \"occurred_at\":\"2025-...Z\",\"headers\":{},\"payload\":{\"order_id\":42}}

With --exec CMD, CMD runs under `sh -c` for each delivery with that JSON on standard
input and PGBUS_SUBSCRIPTION, PGBUS_EVENT_ID, PGBUS_EVENT_NAME and PGBUS_ATTEMPT in its
environment: exit 0 acks; any other exit is a failed attempt whose error is the end of
the command's standard error, retried with exponential backoff until --max-attempts, then
a dead letter (see `pgbus dead`).

SIGINT or SIGTERM stops it gracefully: nothing more is claimed, deliveries in progress
finish (up to --shutdown-timeout), the rest are released for another consumer.")]
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
    /// Look for work at least this often, whatever the notifications.
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    poll_interval: Duration,
    /// Do not LISTEN; find work by polling only.
    #[arg(long, conflicts_with = "listen_url")]
    poll_only: bool,
    /// LISTEN through this connection instead (e.g. a direct one, when DATABASE_URL
    /// goes through a transaction-mode pooler).
    #[arg(long, value_name = "URL")]
    listen_url: Option<String>,
    /// How long a graceful stop waits for deliveries in progress.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    shutdown_timeout: Duration,
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
}

/// How deliveries are handled.
enum Sink {
    /// Standard output: written with blocking writes (a slow reader slows the
    /// consumer, which is the backpressure wanted).
    Stdout,
    Exec {
        command: String,
        timeout: Option<Duration>,
    },
}

pub(crate) async fn run(args: ConsumeArgs, url: Option<&str>) -> Result<(), Failure> {
    let config = super::database_config(url)?;
    if args.max_attempts.is_some_and(|n| n < 1) {
        return Err(usage("error: --max-attempts must be at least 1"));
    }
    let mut retry = RetryPolicy::exponential(args.retry_base);
    if let Some(n) = args.max_attempts {
        retry = retry.max_attempts(n);
    }
    let mut builder = Bus::builder(config)
        .concurrency(args.concurrency)
        .lease(args.lease)
        .poll_interval(args.poll_interval)
        .poll_only(args.poll_only)
        .shutdown_timeout(args.shutdown_timeout)
        .reconfigure(args.reconfigure)
        .retry(retry);
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
    let running = bus.start().await?;
    let stop = super::shutdown_signal()?;
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

    let sink = Arc::new(match args.exec {
        Some(command) => Sink::Exec {
            command,
            timeout: args.timeout,
        },
        None => Sink::Stdout,
    });
    let counts = Arc::new(Counts::default());
    // Cancelled when standard output is gone: nothing more can be delivered.
    let broken = CancellationToken::new();
    let mut work = Box::pin(
        subscription.for_each_concurrent(args.concurrency, |delivery| {
            let sink = sink.clone();
            let counts = counts.clone();
            let broken = broken.clone();
            async move { handle(&sink, delivery, &counts, &broken).await }
        }),
    );

    let mut outcome = Ok(());
    tokio::select! {
        _ = &mut work => {}
        () = stop => {}
        _ = broken.cancelled() => {
            outcome = Err(failed("error: standard output was closed"));
        }
    }
    eprintln!("pgbus: stopping: finishing deliveries in progress");
    // Keep handling what was handed out while the bus drains; what is still running when
    // the shutdown ends cannot be settled any more: dropping it kills its command, and
    // its lease brings it back.
    let shutdown = running.shutdown();
    tokio::pin!(shutdown);
    let mut work_done = false;
    let stopped = loop {
        tokio::select! {
            r = &mut shutdown => break r,
            _ = &mut work, if !work_done => work_done = true,
        }
    };
    drop(work);
    stopped?;
    eprintln!(
        "pgbus: stopped: {} acked, {} failed attempts",
        counts.acked.load(Ordering::Relaxed),
        counts.failed.load(Ordering::Relaxed)
    );
    outcome
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

async fn handle(sink: &Sink, delivery: Delivery, counts: &Counts, broken: &CancellationToken) {
    let line = delivery_json(&delivery);
    let result = match sink {
        Sink::Stdout => {
            let written = {
                let mut out = std::io::stdout().lock();
                writeln!(out, "{line}").and_then(|()| out.flush())
            };
            if let Err(e) = written {
                broken.cancel();
                Err(format!("could not write to standard output: {e}"))
            } else {
                Ok(())
            }
        }
        Sink::Exec { command, timeout } => run_command(command, *timeout, &delivery, &line).await,
    };
    let (id, attempt) = (delivery.event().id.clone(), delivery.attempt());
    let settled = match result {
        Ok(()) => {
            counts.acked.fetch_add(1, Ordering::Relaxed);
            delivery.ack().await
        }
        Err(error) => {
            counts.failed.fetch_add(1, Ordering::Relaxed);
            eprintln!("pgbus: event {id} attempt {attempt} failed: {error}");
            delivery.fail(HandlerError::new(error)).await
        }
    };
    if let Err(e) = settled {
        eprintln!("pgbus: event {id} attempt {attempt}: {e}");
    }
}

/// Runs `command` with the event on standard input; an error is what to record.
async fn run_command(
    command: &str,
    timeout: Option<Duration>,
    delivery: &Delivery,
    input: &str,
) -> Result<(), String> {
    let event = delivery.event();
    let mut child = tokio::process::Command::new("sh")
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
        // lets the command finish, instead of killing it mid-delivery.
        .process_group(0)
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("could not start sh: {e}"))?;
    let mut stdin = child.stdin.take();
    let mut stderr = child.stderr.take();
    let feed = async {
        if let Some(stdin) = stdin.as_mut() {
            // A command that does not read its input closes the pipe: not an error.
            let _ = stdin.write_all(input.as_bytes()).await;
            let _ = stdin.write_all(b"\n").await;
        }
        drop(stdin);
    };
    let tail = async {
        let mut tail = Vec::new();
        if let Some(stderr) = stderr.as_mut() {
            let mut buf = [0u8; 4096];
            while let Ok(n @ 1..) = stderr.read(&mut buf).await {
                tail.extend_from_slice(&buf[..n]);
                if tail.len() > STDERR_TAIL_BYTES {
                    tail.drain(..tail.len() - STDERR_TAIL_BYTES);
                }
            }
        }
        tail
    };
    let group = child.id();
    let run = async {
        let (_, tail, status) = tokio::join!(feed, tail, child.wait());
        (tail, status)
    };
    let (tail, status) = match timeout {
        Some(limit) => match tokio::time::timeout(limit, run).await {
            Ok(done) => done,
            Err(_) => {
                // The whole process group: the shell and whatever it started.
                if let Some(group) = group {
                    let _ = tokio::process::Command::new("kill")
                        .args(["-KILL", "--", &format!("-{group}")])
                        .status()
                        .await;
                }
                return Err(format!("command timed out after {limit:?}"));
            }
        },
        None => run.await,
    };
    let status = status.map_err(|e| format!("could not wait for the command: {e}"))?;
    if status.success() {
        return Ok(());
    }
    let tail = String::from_utf8_lossy(&tail);
    let tail = tail.trim();
    Err(if tail.is_empty() {
        format!("command failed ({status})")
    } else {
        format!("command failed ({status}): {tail}")
    })
}
