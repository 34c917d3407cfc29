//! `latency`: an idle bus, one producer committing one event per transaction a few
//! milliseconds apart; latency is the handler's start minus the producer's commit
//! returning, on one monotonic clock in one process. The floor, in the same run: a bare
//! `NOTIFY` committed on one connection and arriving on another that LISTENs.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::json;
use tokio_postgres::AsyncMessage;

use super::{BenchArgs, BenchDb, Report, Runs, Server, Target, histogram, record, wait_until};

/// The idle latency targets, commit returned -> handler started (ms).
const TARGET_P50_MS: f64 = 0.5;
const TARGET_P99_MS: f64 = 1.5;
use pgbus::Event;
use pgbus::{Error, Result};

/// Events published before the measured ones (connections, prepared statements, caches).
const WARMUP: usize = 20;

/// Instants relative to one base, as nanoseconds (0 = not yet).
#[derive(Debug)]
pub(crate) struct Stamps {
    base: Instant,
    at: Vec<AtomicU64>,
    count: AtomicUsize,
}

impl Stamps {
    pub(crate) fn new(base: Instant, n: usize) -> Stamps {
        Stamps {
            base,
            at: (0..n).map(|_| AtomicU64::new(0)).collect(),
            count: AtomicUsize::new(0),
        }
    }

    /// Records `now` for slot `i` (the first time only).
    pub(crate) fn mark(&self, i: usize, now: Instant) {
        if let Some(slot) = self.at.get(i) {
            let nanos = now.duration_since(self.base).as_nanos().max(1) as u64;
            if slot
                .compare_exchange(0, nanos, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                self.count.fetch_add(1, Ordering::AcqRel);
            }
        }
    }

    pub(crate) fn count(&self) -> usize {
        self.count.load(Ordering::Acquire)
    }

    pub(crate) fn get(&self, i: usize) -> Option<Duration> {
        match self.at.get(i)?.load(Ordering::Acquire) {
            0 => None,
            n => Some(Duration::from_nanos(n)),
        }
    }
}

/// The payload index of a bench event.
pub(crate) fn index_of(event: &Event) -> usize {
    event.payload["i"].as_u64().unwrap_or(u64::MAX) as usize
}

/// Latency of `from[i]` → `to[i]` for `i` in `range`, clamped at zero, into a histogram;
/// returns it with the count of slots that had both stamps.
pub(crate) fn latencies(
    from: &Stamps,
    to: &Stamps,
    range: std::ops::Range<usize>,
) -> (hdrhistogram::Histogram<u64>, usize) {
    let mut h = histogram();
    let mut n = 0;
    for i in range {
        if let (Some(a), Some(b)) = (from.get(i), to.get(i)) {
            record(&mut h, b.saturating_sub(a));
            n += 1;
        }
    }
    (h, n)
}

pub(super) async fn run(server: &Server, args: &BenchArgs, poll_only: bool) -> Result<Report> {
    let n = args.knobs.events as usize;
    let mut runs = Runs::default();
    for _ in 0..args.runs {
        let db = server.fresh_database("latency").await?;
        let result = once(&db, args, poll_only).await;
        db.drop_database().await?;
        let (bus, floor, commit) = result?;
        runs.push_percentiles("bus.", &bus);
        runs.push_percentiles("floor.", &floor);
        runs.push_percentiles("commit.", &commit);
        runs.push(
            "ratio.p50",
            runs_last(&bus, 0.50) / runs_last(&floor, 0.50).max(0.001),
        );
        runs.push(
            "ratio.p99",
            runs_last(&bus, 0.99) / runs_last(&floor, 0.99).max(0.001),
        );
    }
    let mode = if poll_only { "poll-only" } else { "push" };
    let mut object = runs.json("bus.");
    object.insert("mode".into(), json!(mode));
    object.insert("events".into(), json!(n));
    object.insert("interval_ms".into(), json!(args.knobs.interval_ms));
    let mut floor = runs.json("floor.");
    floor.insert(
        "what".into(),
        json!("commit of a bare NOTIFY returned -> its arrival on a LISTENing connection"),
    );
    object.insert("floor".into(), floor.into());
    object.insert("commit".into(), runs.json("commit.").into());
    object.insert("ratio".into(), runs.json("ratio.").into());
    let text = format!(
        "{n} events, one per transaction, {} ms apart, bus {mode}\n\
         commit returned -> handler started: {}\n\
           p50 {} ms, p99 {} ms\n\
         floor (bare NOTIFY commit returned -> arrival): {}\n\
         ratio bus / floor: p50 {}, p99 {}\n\
         the producer's commit itself (BEGIN/publish/COMMIT round trips): {}",
        args.knobs.interval_ms,
        runs.show_latency("bus."),
        runs.show("bus.p50_ms"),
        runs.show("bus.p99_ms"),
        runs.show_latency("floor."),
        runs.show("ratio.p50"),
        runs.show("ratio.p99"),
        runs.show_latency("commit."),
    );
    // The targets are the push mode's: poll-only shows what the fallback timer alone gives.
    let targets = if poll_only {
        Vec::new()
    } else {
        vec![
            Target::at_most(
                "latency_p50_ms",
                runs.median("bus.p50_ms"),
                TARGET_P50_MS,
                "idle bus, commit returned -> handler started, p50 (ms)",
            ),
            Target::at_most(
                "latency_p99_ms",
                runs.median("bus.p99_ms"),
                TARGET_P99_MS,
                "idle bus, commit returned -> handler started, p99 (ms)",
            ),
        ]
    };
    Ok(Report {
        json: object.into(),
        text,
        targets,
    })
}

fn runs_last(h: &hdrhistogram::Histogram<u64>, q: f64) -> f64 {
    h.value_at_quantile(q) as f64 / 1000.0
}

type Hist = hdrhistogram::Histogram<u64>;

/// One run: the floor, then the bus. Returns the bus's latencies, the floor's, and the
/// producer's publish transaction times.
async fn once(db: &BenchDb, args: &BenchArgs, poll_only: bool) -> Result<(Hist, Hist, Hist)> {
    let n = args.knobs.events as usize;
    let gap = Duration::from_millis(args.knobs.interval_ms);
    let floor = notify_floor(db, n, gap).await?;

    let base = Instant::now();
    let total = WARMUP + n;
    let commits = Arc::new(Stamps::new(base, total));
    let starts = Arc::new(Stamps::new(base, total));
    let handler_starts = starts.clone();
    let bus = super::bus(&db.config, args)
        .poll_only(poll_only)
        .handler_fn("bench-latency", ["bench.latency"], move |event| {
            handler_starts.mark(index_of(&event), Instant::now());
            async { Ok(()) }
        })
        .build()?;
    let running = bus.start().await?;
    if !poll_only {
        wait_until(Duration::from_secs(10), || running.is_listening()).await;
    }
    let mut client = db.connect().await?;
    let mut commit_times = histogram();
    let payload = json!({"order_id": 0, "amount": 4200, "currency": "EUR"});
    for i in 0..total {
        let mut p = payload.clone();
        p["i"] = json!(i);
        let event = Event::new("bench.latency", p).aggregate("order", i.to_string());
        let began = Instant::now();
        let tx = client.transaction().await?;
        pgbus::publish(&tx, &event).await?;
        tx.commit().await?;
        let now = Instant::now();
        commits.mark(i, now);
        if i >= WARMUP {
            record(&mut commit_times, now - began);
        }
        if i + 1 == WARMUP {
            // Let the warm-up drain before measuring.
            wait_until(Duration::from_secs(5), || starts.count() >= WARMUP).await;
        }
        tokio::time::sleep(gap).await;
    }
    let delivered = wait_until(Duration::from_secs(30), || starts.count() >= total).await;
    running.shutdown().await?;
    if !delivered {
        return Err(Error::Timeout(
            "waiting for the latency events to be handled",
        ));
    }
    let (h, _) = latencies(&commits, &starts, WARMUP..total);
    Ok((h, floor, commit_times))
}

/// The raw LISTEN/NOTIFY round trip: a bare `NOTIFY` committed on one connection, its
/// arrival on a listening connection driven by `poll_message`.
async fn notify_floor(db: &BenchDb, n: usize, gap: Duration) -> Result<Hist> {
    let (listener, mut messages) = db.config.connect_with_messages().await?;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Instant>();
    let reader = tokio::spawn(async move {
        while let Some(Ok(message)) = messages.next().await {
            if let AsyncMessage::Notification(_) = message {
                let _ = tx.send(Instant::now());
            }
        }
    });
    listener.batch_execute("LISTEN pgbus_bench_floor").await?;
    let producer = db.connect().await?;
    let mut h = histogram();
    for i in 0..WARMUP + n {
        producer
            .batch_execute("BEGIN; NOTIFY pgbus_bench_floor; COMMIT")
            .await?;
        let committed = Instant::now();
        let arrived = tokio::time::timeout(Duration::from_secs(5), rx.recv())
            .await
            .map_err(|_| Error::Timeout("waiting for a notification"))?
            .ok_or(Error::Closed)?;
        if i >= WARMUP {
            record(&mut h, arrived.saturating_duration_since(committed));
        }
        tokio::time::sleep(gap).await;
    }
    drop(listener);
    reader.abort();
    Ok(h)
}
