//! `mixed`: producers commit single-event transactions on a fixed schedule (an offered
//! rate) while a bus consumes; latency from commit returned to handler started, and
//! whether the bus keeps up.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;

use super::latency::{Stamps, index_of, latencies};
use super::{BenchArgs, Report, Runs, Server, wait_until};
use pgbus::Event;
use pgbus::{Error, Result};

/// Default seconds of offered load per rate.
const DEFAULT_SECONDS: f64 = 5.0;
/// Concurrent producers sharing the offered rate: one per 100 events/s, 8 to 64. A
/// durable single-event commit takes a millisecond or more, so one producer cannot offer
/// more than a few hundred events per second.
fn producers(rate: u64) -> usize {
    (rate / 100).clamp(8, 64) as usize
}

pub(super) async fn run(server: &Server, args: &BenchArgs) -> Result<Report> {
    let seconds = args.knobs.seconds.unwrap_or(DEFAULT_SECONDS);
    let mut cases = Vec::new();
    let mut text = String::new();
    for &rate in &args.knobs.rate {
        let mut runs = Runs::default();
        let mut kept = Vec::new();
        let mut reached = Vec::new();
        for _ in 0..args.runs {
            let r = once(server, rate, seconds, args).await?;
            runs.push_percentiles("", &r.latency);
            runs.push("published_per_s", r.published_per_s);
            runs.push("delivered_per_s", r.delivered_per_s);
            runs.push("drain_after_last_commit_ms", r.drain_after_ms);
            runs.push("max_lag_events", r.max_lag as f64);
            kept.push(r.keeps_up);
            reached.push(r.published_per_s >= 0.95 * rate as f64);
        }
        let keeps_up = kept.iter().all(|k| *k);
        let mut case = runs.json("");
        case.insert("offered_per_s".into(), json!(rate));
        case.insert("events_per_s".into(), case["delivered_per_s"].clone());
        case.insert("keeps_up".into(), json!(keeps_up));
        case.insert("keeps_up_runs".into(), json!(kept));
        case.insert("rate_reached_runs".into(), json!(reached));
        case.insert("seconds".into(), json!(seconds));
        case.insert("producers".into(), json!(producers(rate)));
        case.insert("concurrency".into(), json!(args.knobs.concurrency));
        text.push_str(&format!(
            "offered {rate} events/s for {seconds} s ({} producers, one event per transaction), \
             bus concurrency {}:\n  commit returned -> handler started: {}\n  p99 {} ms\n  \
             published {} events/s{}, delivered {} events/s, largest lag {} events, \
             drained {} ms after the last commit: {}\n",
            producers(rate),
            args.knobs.concurrency,
            runs.show_latency(""),
            runs.show("p99_ms"),
            runs.show("published_per_s"),
            if reached.iter().all(|o| *o) {
                ""
            } else {
                " (short of the offered rate: the producers' commits are the limit)"
            },
            runs.show("delivered_per_s"),
            runs.show("max_lag_events"),
            runs.show("drain_after_last_commit_ms"),
            if keeps_up {
                "the bus keeps up"
            } else {
                "the bus FALLS BEHIND"
            },
        ));
        cases.push(case);
    }
    Ok(Report::of_cases(cases, 0, text))
}

struct Mixed {
    latency: hdrhistogram::Histogram<u64>,
    published_per_s: f64,
    delivered_per_s: f64,
    drain_after_ms: f64,
    max_lag: u64,
    keeps_up: bool,
}

async fn once(server: &Server, rate: u64, seconds: f64, args: &BenchArgs) -> Result<Mixed> {
    let db = server.fresh_database("mixed").await?;
    let result = async {
        let total = ((rate as f64 * seconds) as usize).max(1);
        let base = Instant::now();
        let commits = Arc::new(Stamps::new(base, total));
        let starts = Arc::new(Stamps::new(base, total));
        let handler_starts = starts.clone();
        let running = super::bus(&db.config, args)
            .handler_fn("bench-mixed", ["bench.mixed"], move |event| {
                handler_starts.mark(index_of(&event), Instant::now());
                async { Ok(()) }
            })
            .build()?
            .start()
            .await?;
        wait_until(Duration::from_secs(10), || running.is_listening()).await;
        let mut clients = Vec::new();
        let producers = producers(rate);
        for _ in 0..producers {
            clients.push(db.connect().await?);
        }
        let start = tokio::time::Instant::now() + Duration::from_millis(50);
        let mut tasks = Vec::new();
        for (k, mut client) in clients.into_iter().enumerate() {
            let commits = commits.clone();
            tasks.push(tokio::spawn(async move {
                let mut i = k;
                while i < total {
                    let due = start + Duration::from_secs_f64(i as f64 / rate as f64);
                    tokio::time::sleep_until(due).await;
                    let event = Event::new(
                        "bench.mixed",
                        json!({"i": i, "amount": 4200, "currency": "EUR"}),
                    )
                    .aggregate("order", i.to_string());
                    let tx = client.transaction().await?;
                    pgbus::publish(&tx, &event).await?;
                    tx.commit().await?;
                    commits.mark(i, Instant::now());
                    i += producers;
                }
                Ok::<_, Error>(())
            }));
        }
        let started = Instant::now();
        let mut max_lag = 0u64;
        let producing = async {
            for t in tasks {
                t.await.map_err(|_| Error::Closed)??;
            }
            Ok::<_, Error>(())
        };
        tokio::pin!(producing);
        loop {
            tokio::select! {
                r = &mut producing => { r?; break; }
                _ = tokio::time::sleep(Duration::from_millis(10)) => {
                    let lag = commits.count().saturating_sub(starts.count()) as u64;
                    max_lag = max_lag.max(lag);
                }
            }
        }
        let last_commit = Instant::now();
        let published_secs = last_commit.duration_since(started).as_secs_f64() - 0.05;
        let drained = wait_until(Duration::from_secs(60), || starts.count() >= total).await;
        let drain_after = last_commit.elapsed();
        let delivered_secs = started.elapsed().as_secs_f64() - 0.05;
        running.shutdown().await?;
        if !drained {
            return Err(Error::Timeout("waiting for the mixed workload to drain"));
        }
        let (latency, _) = latencies(&commits, &starts, 0..total);
        let published_per_s = total as f64 / published_secs.max(1e-9);
        Ok(Mixed {
            latency,
            published_per_s,
            delivered_per_s: total as f64 / delivered_secs.max(1e-9),
            drain_after_ms: drain_after.as_secs_f64() * 1000.0,
            max_lag,
            keeps_up: drain_after < Duration::from_secs(1),
        })
    }
    .await;
    db.drop_database().await?;
    result
}
