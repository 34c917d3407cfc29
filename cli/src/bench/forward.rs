//! `forward`: `pgbus forward`'s relay into NATS JetStream (a `nats-server -js` of its own,
//! file storage, started for each run). Two figures:
//!
//! - drain: a backlog already pending, forwarded with `--concurrency` publishes in flight;
//!   events per second from the bus's start to the last PubAck. Unordered, then ordered
//!   over `--ordered-keys` keys (100 when 0 is given).
//! - latency at idle: one event per transaction a few milliseconds apart; commit returned
//!   → JetStream's PubAck received, on one monotonic clock in one process.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use pgbus::{Bus, Event, Result, SubscriptionOptions};
use pgbus_testkit::nats::NatsServer;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use super::latency::{Stamps, index_of, latencies};
use super::{BenchArgs, Report, Runs, Server, seed_keyed_backlog, wait_until};
use crate::cli::forward::{Counts, forward};
use crate::cli::jetstream::{JetStream, NatsArgs};
use crate::cli::sink::{Sink, SinkError, Stored};

/// The default backlog.
const DEFAULT_BACKLOG: u64 = 20_000;
/// Publishes in flight.
const CONCURRENCY: usize = 256;
/// The ordered case's keys when `--ordered-keys` is 0.
const DEFAULT_KEYS: u64 = 100;
/// Latency events published before the measured ones.
const WARMUP: usize = 20;
/// The forwarder's lease.
const LEASE: Duration = Duration::from_secs(60);

fn nats_error(e: impl std::fmt::Display) -> pgbus::Error {
    super::invalid("nats", e.to_string())
}

/// A running NATS and the JetStream sink on it.
async fn sink() -> Result<(NatsServer, JetStream)> {
    let nats = NatsServer::start().await.map_err(nats_error)?;
    let sink = JetStream::connect(&NatsArgs::url(nats.url()), "PGBUS", "pgbus", LEASE)
        .await
        .map_err(|f| nats_error(f.message))?;
    Ok((nats, sink))
}

pub(super) async fn run(server: &Server, args: &BenchArgs) -> Result<Report> {
    let backlog = args
        .knobs
        .backlog
        .first()
        .copied()
        .unwrap_or(DEFAULT_BACKLOG);
    let keys = match args.knobs.ordered_keys {
        0 => DEFAULT_KEYS,
        n => n,
    };
    let mut runs = Runs::default();
    for _ in 0..args.runs {
        runs.push("unordered_per_s", drain(server, backlog, 0).await?);
        runs.push("ordered_per_s", drain(server, backlog, keys).await?);
        runs.push_percentiles("latency.", &latency(server, args).await?);
    }
    let mut object = runs.json("latency.");
    object.insert("backlog".into(), json!(backlog));
    object.insert("concurrency".into(), json!(CONCURRENCY));
    object.insert("ordered_keys".into(), json!(keys));
    object.insert(
        "unordered_per_s".into(),
        json!(runs.median("unordered_per_s")),
    );
    object.insert("ordered_per_s".into(), json!(runs.median("ordered_per_s")));
    let text = format!(
        "backlog {backlog} into JetStream (file storage), {CONCURRENCY} publishes in flight:\n\
           unordered: {} events/s\n\
           ordered, {keys} keys: {} events/s\n\
         idle, one event per transaction, {} ms apart: commit returned -> PubAck: {}",
        runs.show("unordered_per_s"),
        runs.show("ordered_per_s"),
        args.knobs.interval_ms,
        runs.show_latency("latency."),
    );
    Ok(Report {
        json: object.into(),
        text,
        targets: Vec::new(),
    })
}

/// Seeds `backlog` events (over `keys` ordering keys, ordered when > 0) and times the
/// forwarder relaying them; events per second.
async fn drain(server: &Server, backlog: u64, keys: u64) -> Result<f64> {
    let db = server.fresh_database("forward").await?;
    let result = async {
        let client = db.connect().await?;
        let name = "bench-forward".to_string();
        seed_keyed_backlog(
            &client,
            std::slice::from_ref(&name),
            "bench.drain",
            backlog,
            keys,
        )
        .await?;
        let (_nats, sink) = sink().await?;
        let mut bus = Bus::builder(db.config.clone())
            .concurrency(CONCURRENCY)
            .lease(LEASE)
            .build()?;
        let subscription = bus.subscribe_with(
            &name,
            ["bench.drain"],
            SubscriptionOptions::new().ordered(keys > 0),
        )?;
        let counts = Arc::new(Counts::default());
        let stop = CancellationToken::new();
        let started = Instant::now();
        let running = bus.start().await?;
        let work = tokio::spawn(forward(
            subscription,
            Arc::new(sink),
            CONCURRENCY,
            stop.clone(),
            counts.clone(),
        ));
        let done = wait_until(Duration::from_secs(600), || {
            counts.forwarded.load(Ordering::Relaxed) >= backlog
        })
        .await;
        let elapsed = started.elapsed().as_secs_f64();
        stop.cancel();
        running.shutdown().await?;
        let _ = work.await;
        if !done {
            return Err(pgbus::Error::Timeout("forwarding the backlog"));
        }
        Ok(backlog as f64 / elapsed)
    }
    .await;
    db.drop_database().await?;
    result
}

/// A sink that stamps each event's PubAck.
struct Stamped {
    inner: JetStream,
    acks: Arc<Stamps>,
}

impl Sink for Stamped {
    fn refused(&self) -> BoxFuture<'static, String> {
        self.inner.refused()
    }

    fn publish<'a>(&'a self, event: &'a Event) -> BoxFuture<'a, Result<Stored, SinkError>> {
        Box::pin(async move {
            let stored = self.inner.publish(event).await?;
            self.acks.mark(index_of(event), Instant::now());
            Ok(stored)
        })
    }
}

/// Commit returned → PubAck, at idle.
async fn latency(server: &Server, args: &BenchArgs) -> Result<hdrhistogram::Histogram<u64>> {
    let n = args.knobs.events as usize;
    let gap = Duration::from_millis(args.knobs.interval_ms);
    let db = server.fresh_database("forward_latency").await?;
    let result = async {
        let (_nats, inner) = sink().await?;
        let total = WARMUP + n;
        let base = Instant::now();
        let commits = Arc::new(Stamps::new(base, total));
        let acks = Arc::new(Stamps::new(base, total));
        let mut bus = Bus::builder(db.config.clone())
            .concurrency(CONCURRENCY)
            .lease(LEASE)
            .build()?;
        let subscription = bus.subscribe("bench-forward-latency", ["bench.latency"])?;
        let stop = CancellationToken::new();
        let running = bus.start().await?;
        wait_until(Duration::from_secs(10), || running.is_listening()).await;
        let sink = Stamped {
            inner,
            acks: acks.clone(),
        };
        let work = tokio::spawn(forward(
            subscription,
            Arc::new(sink),
            CONCURRENCY,
            stop.clone(),
            Arc::new(Counts::default()),
        ));
        let mut client = db.connect().await?;
        for i in 0..total {
            let event = Event::new("bench.latency", json!({"i": i, "amount": 4200}));
            let tx = client.transaction().await?;
            pgbus::publish(&tx, &event).await?;
            tx.commit().await?;
            commits.mark(i, Instant::now());
            if i + 1 == WARMUP {
                wait_until(Duration::from_secs(5), || acks.count() >= WARMUP).await;
            }
            tokio::time::sleep(gap).await;
        }
        let done = wait_until(Duration::from_secs(30), || acks.count() >= total).await;
        stop.cancel();
        running.shutdown().await?;
        let _ = work.await;
        if !done {
            return Err(pgbus::Error::Timeout("waiting for the PubAcks"));
        }
        let (h, _) = latencies(&commits, &acks, WARMUP..total);
        Ok(h)
    }
    .await;
    db.drop_database().await?;
    result
}
