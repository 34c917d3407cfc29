//! `batch`: what one publish call costs, and whether `publish_batch`'s arrays expanded
//! with `unnest` (one round trip) beat binary COPY into a temporary table followed by
//! the same `INSERT ... SELECT` (two round trips). One publisher, one subscription, each
//! call in its own transaction (`BEGIN`, the call, `COMMIT`).

use std::time::{Duration, Instant};

use serde_json::json;
use tokio_postgres::Client;

use pgbus::{Event, Result, publish_batch};

use super::{
    BenchArgs, Report, Runs, Server, histogram, prepare_copy, publish_by_copy, record,
    sample_events,
};

/// Default seconds per size and method.
const DEFAULT_SECONDS: f64 = 2.0;
/// The fewest calls timed per size and method.
const MIN_CALLS: usize = 5;

/// How a call publishes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Method {
    /// `pgbus::publish`, one event.
    Publish,
    /// `pgbus::publish_batch`: arrays and `unnest`.
    Unnest,
    /// Binary COPY into a temporary table, then `publish_batch`'s statement over it.
    Copy,
}

impl Method {
    fn name(self) -> &'static str {
        match self {
            Method::Publish => "publish",
            Method::Unnest => "unnest",
            Method::Copy => "copy",
        }
    }
}

/// Publishes one batch of `events` in its own transaction by `method`; returns the
/// time of the call alone and of the whole transaction.
pub(crate) async fn one_call(
    client: &mut Client,
    method: Method,
    events: &[Event],
) -> Result<(Duration, Duration)> {
    let began = Instant::now();
    let tx = client.transaction().await?;
    let call = Instant::now();
    match method {
        Method::Publish => {
            pgbus::publish(&tx, &events[0]).await?;
        }
        Method::Unnest => {
            publish_batch(&tx, events).await?;
        }
        Method::Copy => {
            publish_by_copy(&tx, events).await?;
        }
    }
    let call = call.elapsed();
    tx.commit().await?;
    Ok((call, began.elapsed()))
}

pub(super) async fn run(server: &Server, args: &BenchArgs) -> Result<Report> {
    let seconds = args.knobs.seconds.unwrap_or(DEFAULT_SECONDS);
    let mut cells: Vec<(Method, usize)> = vec![(Method::Publish, 1)];
    for &size in &args.knobs.sizes {
        cells.push((Method::Unnest, size));
        cells.push((Method::Copy, size));
    }
    let mut runs = Runs::default();
    for _ in 0..args.runs {
        let db = server.fresh_database("batch").await?;
        let result = async {
            let mut client = db.connect().await?;
            pgbus::admin::register_subscription(&client, "bench-batch", &["bench.*"], 25).await?;
            prepare_copy(&client).await?;
            let mut next = 0u64;
            for &(method, size) in &cells {
                client
                    .batch_execute("TRUNCATE pgbus.events, pgbus.deliveries")
                    .await?;
                let _ = client.batch_execute("CHECKPOINT").await;
                // One untimed call: plans and caches.
                let events = sample_events(size, next);
                next += size as u64;
                one_call(&mut client, method, &events).await?;
                let mut call_h = histogram();
                let mut tx_h = histogram();
                let started = Instant::now();
                let mut calls = 0usize;
                let mut busy = Duration::ZERO;
                while calls < MIN_CALLS || started.elapsed().as_secs_f64() < seconds {
                    let events = sample_events(size, next);
                    next += size as u64;
                    let (call, whole) = one_call(&mut client, method, &events).await?;
                    record(&mut call_h, call);
                    record(&mut tx_h, whole);
                    busy += whole;
                    calls += 1;
                }
                let name = format!("{}/{size}/", method.name());
                runs.push(
                    &format!("{name}call_p50_ms"),
                    call_h.value_at_quantile(0.5) as f64 / 1000.0,
                );
                runs.push(
                    &format!("{name}tx_p50_ms"),
                    tx_h.value_at_quantile(0.5) as f64 / 1000.0,
                );
                runs.push(
                    &format!("{name}tx_p99_ms"),
                    tx_h.value_at_quantile(0.99) as f64 / 1000.0,
                );
                runs.push(
                    &format!("{name}events_per_s"),
                    (calls * size) as f64 / busy.as_secs_f64(),
                );
            }
            Ok::<_, pgbus::Error>(())
        }
        .await;
        db.drop_database().await?;
        result?;
    }
    let mut text = format!(
        "one publisher, each call in its own transaction (BEGIN, call, COMMIT), \
         at least {seconds} s and {MIN_CALLS} calls per cell\n"
    );
    let mut cases = Vec::new();
    for &(method, size) in &cells {
        let name = format!("{}/{size}/", method.name());
        text.push_str(&format!(
            "{:>8} {size:>6} events: call p50 {} ms; transaction p50 {} ms, p99 {} ms; {} events/s\n",
            method.name(),
            runs.show(&format!("{name}call_p50_ms")),
            runs.show(&format!("{name}tx_p50_ms")),
            runs.show(&format!("{name}tx_p99_ms")),
            runs.show(&format!("{name}events_per_s")),
        ));
        let mut case = runs.json(&name);
        case.insert("method".into(), json!(method.name()));
        case.insert("events".into(), json!(size));
        cases.push(serde_json::Value::Object(case));
    }
    for &size in &args.knobs.sizes {
        let u = runs.median(&format!("unnest/{size}/events_per_s"));
        let c = runs.median(&format!("copy/{size}/events_per_s"));
        text.push_str(&format!(
            "size {size}: COPY / unnest = {:.2} (events/s)\n",
            c / u
        ));
    }
    let mut object = serde_json::Map::new();
    object.insert(
        "events_per_s".into(),
        json!(super::round(runs.median("publish/1/events_per_s"))),
    );
    object.insert("cases".into(), json!(cases));
    Ok(Report {
        json: object.into(),
        text,
        targets: Vec::new(),
    })
}
