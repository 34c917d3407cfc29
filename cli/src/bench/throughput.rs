//! `throughput`: a backlog already pending, drained by one bus with no-op handlers;
//! events per second from the bus's start to the last acknowledgement committed. With a
//! fan-out of 4, every event has four subscriptions and four deliveries.

use std::time::{Duration, Instant};

use serde_json::json;

use super::{BenchArgs, Report, Runs, Server, Target, seed_keyed_backlog};

/// The drain target: deliveries per second of a 20,000 backlog at concurrency 8.
const TARGET_DRAIN_PER_S: f64 = 28_000.0;
/// How much slower per event a 1,000,000 backlog may drain than a 20,000 one.
const TARGET_DEEP_SLOWDOWN: f64 = 1.3;
use pgbus::{Error, Result};

/// The default backlog.
const DEFAULT_BACKLOG: u64 = 20_000;
/// The first deliveries timed on their own: the rate while nearly the whole backlog is
/// still pending.
const FIRST: u64 = 20_000;

pub(super) async fn run(server: &Server, args: &BenchArgs) -> Result<Report> {
    let backlogs = if args.knobs.backlog.is_empty() {
        vec![DEFAULT_BACKLOG]
    } else {
        args.knobs.backlog.clone()
    };
    let fan_outs = if args.knobs.fan_out.is_empty() {
        vec![1, 4]
    } else {
        args.knobs.fan_out.clone()
    };
    let mut cases = Vec::new();
    let mut text = String::new();
    // Unordered fan-out 1 rates by backlog, for the targets.
    let mut single = Vec::new();
    for &backlog in &backlogs {
        for &fan_out in &fan_outs {
            let mut runs = Runs::default();
            for _ in 0..args.runs {
                let r = drain(server, backlog, fan_out, args).await?;
                runs.push("events_per_s", r.events_per_s);
                runs.push("deliveries_per_s", r.deliveries_per_s);
                runs.push("seconds", r.seconds);
                runs.push("deliveries_per_claim", r.deliveries_per_claim);
                if let Some(first) = r.first_per_s {
                    runs.push("first_deliveries_per_s", first);
                }
            }
            let mut case = runs.json("");
            case.insert("backlog".into(), json!(backlog));
            case.insert("fan_out".into(), json!(fan_out));
            case.insert("concurrency".into(), json!(args.knobs.concurrency));
            case.insert("ordered_keys".into(), json!(args.knobs.ordered_keys));
            if args.knobs.ordered_keys > 0 {
                text.push_str(&format!(
                    "ordered, {} ordering keys: ",
                    args.knobs.ordered_keys
                ));
            }
            text.push_str(&format!(
                "backlog {backlog}, {fan_out} subscription(s) per event, concurrency {}: \
                 {} deliveries/s ({} events/s; {} s; {} deliveries per claim)\n",
                args.knobs.concurrency,
                runs.show("deliveries_per_s"),
                runs.show("events_per_s"),
                runs.show("seconds"),
                runs.show("deliveries_per_claim"),
            ));
            if backlog > FIRST * fan_out as u64 {
                text.push_str(&format!(
                    "  the first {FIRST} deliveries (nearly all the backlog still pending): {} deliveries/s\n",
                    runs.show("first_deliveries_per_s")
                ));
            }
            if fan_out == 1 && args.knobs.ordered_keys == 0 {
                single.push((backlog, runs.median("deliveries_per_s")));
            }
            cases.push(case);
        }
    }
    let mut report = Report::of_cases(cases, 0, text);
    let rate = |n: u64| single.iter().find(|(b, _)| *b == n).map(|(_, r)| *r);
    if let (8, Some(r)) = (args.knobs.concurrency, rate(20_000)) {
        report.targets.push(Target::at_least(
            "drain_20000_per_s",
            r,
            TARGET_DRAIN_PER_S,
            "a 20,000 backlog drained at concurrency 8, one subscription (deliveries/s)",
        ));
        if let Some(deep) = rate(1_000_000) {
            report.targets.push(Target::at_most(
                "drain_1000000_slowdown",
                r / deep,
                TARGET_DEEP_SLOWDOWN,
                "time per event draining 1,000,000 / draining 20,000",
            ));
        }
    }
    Ok(report)
}

/// One drain's figures.
#[derive(Debug)]
pub(crate) struct Drain {
    pub(crate) seconds: f64,
    pub(crate) events_per_s: f64,
    pub(crate) deliveries_per_s: f64,
    /// The rate of the first [`FIRST`] deliveries, when the backlog is larger.
    pub(crate) first_per_s: Option<f64>,
    /// Deliveries per claim statement (claims that found nothing included).
    pub(crate) deliveries_per_claim: f64,
}

/// Seeds `backlog` events with `fan_out` subscriptions each in a fresh database, then
/// times a bus with no-op handlers draining them.
pub(crate) async fn drain(
    server: &Server,
    backlog: u64,
    fan_out: u32,
    args: &BenchArgs,
) -> Result<Drain> {
    let db = server.fresh_database("throughput").await?;
    let result = async {
        let client = db.connect().await?;
        let subs: Vec<String> = (0..fan_out).map(|k| format!("bench-drain-{k}")).collect();
        let keys = args.knobs.ordered_keys;
        seed_keyed_backlog(&client, &subs, "bench.drain", backlog, keys).await?;
        let total = backlog * fan_out as u64;
        let mut builder = super::bus(&db.config, args);
        for name in &subs {
            builder = builder.handler_fn_with(
                name,
                ["bench.drain"],
                pgbus::SubscriptionOptions::new().ordered(keys > 0),
                |_event| async { Ok(()) },
            );
        }
        let bus = builder.build()?;
        let started = Instant::now();
        let running = bus.start().await?;
        let mut first = None;
        let deadline = Duration::from_secs(600) + Duration::from_millis(total);
        loop {
            let delivered = running.stats().delivered;
            if first.is_none() && delivered >= FIRST && total > FIRST {
                first = Some(started.elapsed());
            }
            if delivered >= total {
                break;
            }
            if started.elapsed() > deadline {
                return Err(Error::Timeout("draining the backlog"));
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let elapsed = started.elapsed().as_secs_f64();
        let claims = running.stats().claims;
        running.shutdown().await?;
        let left: i64 = client
            .query_one("SELECT count(*) FROM pgbus.deliveries", &[])
            .await?
            .get(0);
        if left != 0 {
            return Err(super::invalid(
                "bench",
                format!("{left} deliveries left after the drain"),
            ));
        }
        Ok(Drain {
            seconds: elapsed,
            events_per_s: backlog as f64 / elapsed,
            deliveries_per_s: total as f64 / elapsed,
            first_per_s: first.map(|d| FIRST as f64 / d.as_secs_f64()),
            deliveries_per_claim: total as f64 / claims.max(1) as f64,
        })
    }
    .await;
    db.drop_database().await?;
    result
}
