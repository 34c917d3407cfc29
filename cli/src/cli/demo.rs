//! `pgbus demo`: a throwaway PostgreSQL, producers, subscribed handlers (one of them
//! flaky) and a live view of what the bus does.

use std::collections::HashMap;
use std::io::{IsTerminal as _, Write as _};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use pgbus::{Bus, Event, HandlerError, RetryPolicy, SubscriptionOptions};
use pgbus_testkit::embedded::{EmbeddedOptions, EmbeddedPostgres};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use super::{Failure, failed};

/// How many producer tasks publish, each on its own connection.
const PRODUCERS: u32 = 4;
/// The share of attempts the flaky subscription fails.
const FLAKY_FAILURE_RATE: f64 = 0.2;
/// Its attempts before a dead letter.
const FLAKY_ATTEMPTS: i32 = 3;
/// How often the live view is redrawn.
const REFRESH: Duration = Duration::from_millis(250);

/// Arguments of `pgbus demo`.
#[derive(Debug, clap::Args)]
#[command(after_help = "\
Examples:
  cargo run --release -- demo
  pgbus demo --seconds 30 --rate 1000

It starts a throwaway PostgreSQL cluster (initdb in a temporary directory, Unix socket
only; needs PostgreSQL's server binaries, found on PATH, in PG_BIN_DIR or under
/usr/lib/postgresql), and removes it at the end. DATABASE_URL is ignored (every sqlx
project exports one): only with --database-url on its command line does it use a
database of yours, which it migrates and leaves its demo.* events and demo-*
subscriptions in.")]
pub(crate) struct DemoArgs {
    /// How long to run, in seconds (Ctrl-C stops it sooner).
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// Events per second, all producers together.
    #[arg(long, default_value_t = 200)]
    rate: u32,
}

/// The three subscriptions and what each matches.
const SUBSCRIPTIONS: [(&str, &str); 3] = [
    ("demo-projection", "demo.order.*"),
    ("demo-mailer", "demo.order.placed"),
    ("demo-audit", "demo.*"),
];

/// Commit-to-handler latency: the producer notes when its commit returned, the
/// projection handler when it started; whichever comes second records the difference.
#[derive(Debug)]
struct Latency {
    pending: Mutex<HashMap<String, Instant>>,
    histogram: Mutex<Histogram<u64>>,
}

impl Latency {
    fn new() -> Self {
        Latency {
            pending: Mutex::new(HashMap::new()),
            histogram: Mutex::new(
                Histogram::new_with_bounds(1, 60_000_000, 3).expect("valid histogram bounds"),
            ),
        }
    }

    fn committed(&self, id: String, at: Instant) {
        let mut pending = self.pending.lock().expect("latency lock");
        match pending.remove(&id) {
            Some(_) => {
                drop(pending);
                // The handler started before the commit call returned.
                self.record(Duration::ZERO);
            }
            None => {
                pending.insert(id, at);
            }
        }
    }

    fn started(&self, id: &str, at: Instant) {
        let mut pending = self.pending.lock().expect("latency lock");
        match pending.remove(id) {
            Some(committed) => {
                drop(pending);
                self.record(at.saturating_duration_since(committed));
            }
            None => {
                pending.insert(id.to_string(), at);
            }
        }
    }

    fn record(&self, d: Duration) {
        let micros = (d.as_micros() as u64).clamp(1, 60_000_000);
        let _ = self.histogram.lock().expect("latency lock").record(micros);
    }

    fn percentiles(&self) -> (u64, f64, f64) {
        let h = self.histogram.lock().expect("latency lock");
        (
            h.len(),
            h.value_at_quantile(0.5) as f64 / 1000.0,
            h.value_at_quantile(0.99) as f64 / 1000.0,
        )
    }
}

#[derive(Debug, Default)]
struct Counters {
    published: AtomicU64,
    delivered: [AtomicU64; 3],
}

pub(crate) async fn run(args: DemoArgs, url: Option<&str>) -> Result<(), Failure> {
    let (cluster, config) = match url.map(str::trim).filter(|u| !u.is_empty()) {
        Some(url) => (None, super::database_config(Some(url))?),
        None => {
            eprintln!("pgbus demo: starting a throwaway PostgreSQL cluster...");
            let pg = EmbeddedPostgres::start(EmbeddedOptions::default())
                .await
                .map_err(|e| {
                    failed(format!(
                        "error: could not start a throwaway PostgreSQL: {e}\n\
                         hint: install PostgreSQL's server binaries, or set PG_BIN_DIR, \
                         or pass --database-url"
                    ))
                })?;
            eprintln!("pgbus demo: cluster in {}", pg.dir().display());
            let config = pgbus::ConnectConfig::from(pg.config("postgres"));
            (Some(pg), config)
        }
    };
    let result = demo(&args, &config).await;
    if let Some(pg) = cluster {
        let dir = pg.dir().to_path_buf();
        // Stopping the server blocks: not on the runtime's threads.
        let _ = tokio::task::spawn_blocking(move || drop(pg)).await;
        eprintln!(
            "pgbus demo: stopped and removed the throwaway cluster ({})",
            dir.display()
        );
    }
    result
}

async fn demo(args: &DemoArgs, config: &pgbus::ConnectConfig) -> Result<(), Failure> {
    let client = super::connect(config).await?;
    pgbus::migrate(&client).await?;

    let counters = Arc::new(Counters::default());
    let latency = Arc::new(Latency::new());
    let mut builder = Bus::builder(config.clone()).concurrency(32);
    for (i, (name, pattern)) in SUBSCRIPTIONS.into_iter().enumerate() {
        let counters = counters.clone();
        let latency = latency.clone();
        let flaky = name == "demo-mailer";
        let options = if flaky {
            SubscriptionOptions::new().retry(
                RetryPolicy::exponential(Duration::from_millis(100)).max_attempts(FLAKY_ATTEMPTS),
            )
        } else {
            SubscriptionOptions::new()
        };
        builder = builder.handler_fn_with(name, [pattern], options, move |event: Event| {
            let started = Instant::now();
            if i == 0 {
                latency.started(&event.id, started);
            }
            let counters = counters.clone();
            async move {
                if flaky && fastrand::f64() < FLAKY_FAILURE_RATE {
                    return Err(HandlerError::new("smtp: 421 try again later"));
                }
                counters.delivered[i].fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
        });
    }
    let running = builder.build()?.start().await?;

    let stop = CancellationToken::new();
    let mut producers = tokio::task::JoinSet::new();
    let per_producer = Duration::from_secs_f64(f64::from(PRODUCERS) / f64::from(args.rate.max(1)));
    for p in 0..PRODUCERS {
        let mut client = super::connect(config).await?;
        let (stop, counters, latency) = (stop.clone(), counters.clone(), latency.clone());
        producers.spawn(async move {
            let mut tick = tokio::time::interval(per_producer);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut n: u64 = 0;
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return Ok::<(), pgbus::Error>(()),
                    _ = tick.tick() => {}
                }
                n += 1;
                let order = format!("{p}-{n}");
                let name = ["demo.order.placed", "demo.order.paid", "demo.order.shipped"]
                    [(n % 3) as usize];
                let event = Event::new(name, json!({"order_id": order, "total": n % 500}))
                    .aggregate("order", order.clone())
                    .source("pgbus-demo");
                let tx = client.transaction().await?;
                pgbus::publish(&tx, &event).await?;
                tx.commit().await?;
                latency.committed(event.id, Instant::now());
                counters.published.fetch_add(1, Ordering::Relaxed);
            }
        });
    }

    let live = std::io::stdout().is_terminal();
    let started = Instant::now();
    let total = Duration::from_secs(args.seconds);
    let mut refresh = tokio::time::interval(REFRESH);
    let signal = super::shutdown_signal()?;
    tokio::pin!(signal);
    let mut drawn = 0;
    let mut outcome = Ok(());
    loop {
        tokio::select! {
            () = &mut signal => break,
            _ = tokio::time::sleep(total.saturating_sub(started.elapsed())) => break,
            Some(done) = producers.join_next() => {
                if let Ok(Err(e)) = done {
                    outcome = Err(e.into());
                    break;
                }
            }
            _ = refresh.tick() => {
                if live {
                    let view = render(&counters, &running.stats(), &latency, started.elapsed(), total);
                    drawn = redraw(&view, drawn);
                }
            }
        }
    }
    stop.cancel();
    while producers.join_next().await.is_some() {}
    // Let the handlers catch up with the last events published (briefly: a flaky
    // subscription's retries may still be scheduled).
    let caught_up = async {
        while counters.delivered[0].load(Ordering::Relaxed)
            < counters.published.load(Ordering::Relaxed)
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(2), caught_up).await;
    let stats = running.stats();
    running.shutdown().await?;
    let view = render(&counters, &stats, &latency, started.elapsed(), total);
    if live {
        redraw(&view, drawn);
    } else {
        out!("{view}")?;
    }
    outcome
}

/// Replaces the `drawn` lines printed last with `view`; returns how many it printed.
fn redraw(view: &str, drawn: usize) -> usize {
    let mut out = std::io::stdout().lock();
    if drawn > 0 {
        // Up to the first line drawn, then clear to the end of the screen.
        let _ = write!(out, "\x1b[{drawn}F\x1b[J");
    }
    let _ = write!(out, "{view}");
    let _ = out.flush();
    view.lines().count()
}

fn render(
    counters: &Counters,
    stats: &pgbus::Stats,
    latency: &Latency,
    elapsed: Duration,
    total: Duration,
) -> String {
    let published = counters.published.load(Ordering::Relaxed);
    let secs = elapsed.as_secs_f64().max(0.001);
    let (n, p50, p99) = latency.percentiles();
    let mut out = format!(
        "pgbus demo: {PRODUCERS} producers, {} subscriptions, {:.1}s of {}s (Ctrl-C stops)\n\n",
        SUBSCRIPTIONS.len(),
        elapsed.as_secs_f64().min(total.as_secs_f64()),
        total.as_secs()
    );
    out.push_str(&format!(
        "  published              {published:>8}  ({:.0}/s)\n  delivered\n",
        published as f64 / secs
    ));
    for (i, (name, pattern)) in SUBSCRIPTIONS.iter().enumerate() {
        let note = if *name == "demo-mailer" {
            format!(
                "  fails {:.0}% of attempts; {FLAKY_ATTEMPTS} attempts, then dead",
                FLAKY_FAILURE_RATE * 100.0
            )
        } else {
            String::new()
        };
        out.push_str(&format!(
            "    {name:<18} {:>8}  {pattern}{note}\n",
            counters.delivered[i].load(Ordering::Relaxed)
        ));
    }
    out.push_str(&format!(
        "  retries                {:>8}\n  dead letters           {:>8}\n",
        stats.failed.saturating_sub(stats.dead_lettered),
        stats.dead_lettered
    ));
    if n > 0 {
        out.push_str(&format!(
            "  commit -> handler      p50 {p50:.2} ms   p99 {p99:.2} ms   ({n} events, demo-projection)\n"
        ));
    } else {
        out.push_str("  commit -> handler      (no deliveries yet)\n");
    }
    out
}
