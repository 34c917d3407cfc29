//! Prometheus metrics: the `/metrics` endpoint that `pgbus consume --metrics-addr` and
//! `pgbus metrics --listen` serve, and `pgbus metrics`, which only samples the
//! database's gauges.

use std::net::SocketAddr;
use std::time::Duration;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};

use super::{Failure, StopSignals, failed, human_duration, parse_duration};

/// The histograms' buckets, in seconds: from a millisecond to a minute.
const SECONDS_BUCKETS: [f64; 15] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// The claim batch size's buckets, in deliveries.
const BATCH_BUCKETS: [f64; 10] = [1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0];

/// Arguments of `pgbus metrics`.
#[derive(Debug, clap::Args)]
#[command(after_help = "\
Examples:
  pgbus metrics --listen 127.0.0.1:9187
  pgbus metrics --listen 127.0.0.1:9187 --interval 30s
  curl -s http://127.0.0.1:9187/metrics

Serves the backlog gauges of every subscription in the Prometheus text format at
/metrics: pgbus_backlog{subscription,state} (due, scheduled, processing, dead; each
counted up to 100000), pgbus_oldest_due_age_seconds{subscription} and
pgbus_blocked_keys{subscription}, sampled from the database every --interval with one
cheap statement. For deployments whose consumers run in-process (the library, with the
application's own exporter for the delivery counters): run one of these per database.
A `pgbus consume --metrics-addr` serves the same gauges for its own subscription, and
its delivery counters.

A sample that fails (the database is away) is logged and tried again at the next
interval; the gauges keep their last values meanwhile. Stops on SIGINT, SIGTERM or
SIGHUP with exit 0. Exit codes: 1 the database cannot be reached at start or the address
cannot be bound; 2 bad usage (a malformed address).")]
pub(crate) struct MetricsArgs {
    /// Serve /metrics on this address, an IP and a port (e.g. 127.0.0.1:9187).
    #[arg(long, value_name = "IP:PORT", value_parser = parse_addr)]
    listen: SocketAddr,
    /// How often the gauges are sampled from the database.
    #[arg(long, default_value = "15s", value_parser = parse_interval)]
    interval: Duration,
}

/// Parses `--metrics-addr` / `--listen`: an IP address and a port.
pub(crate) fn parse_addr(text: &str) -> Result<SocketAddr, String> {
    text.trim().parse().map_err(|_| {
        format!(
            "invalid address {text:?}: expected an IP address and a port, e.g. 127.0.0.1:9187 \
             or [::1]:9187"
        )
    })
}

/// Parses `--interval`: a duration of at least a second.
fn parse_interval(text: &str) -> Result<Duration, String> {
    let interval = parse_duration(text)?;
    if interval < Duration::from_secs(1) {
        return Err(format!(
            "--interval must be at least 1s, got {}",
            human_duration(interval)
        ));
    }
    Ok(interval)
}

/// Installs the Prometheus exporter as the process's recorder, serving `/metrics` (any
/// path answers) on `addr`, and describes pgbus's metrics to it. Histograms get buckets,
/// so that they can be aggregated across processes.
pub(crate) fn serve(addr: SocketAddr) -> Result<(), Failure> {
    let bucket_error = |e: metrics_exporter_prometheus::BuildError| {
        failed(format!("error: cannot set up the metrics exporter: {e}"))
    };
    PrometheusBuilder::new()
        .with_http_listener(addr)
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &SECONDS_BUCKETS)
        .map_err(bucket_error)?
        .set_buckets_for_metric(
            Matcher::Full(pgbus::metrics::CLAIM_BATCH_SIZE.into()),
            &BATCH_BUCKETS,
        )
        .map_err(bucket_error)?
        .install()
        .map_err(|e| failed(format!("error: cannot serve metrics on {addr}: {e}")))?;
    pgbus::metrics::describe();
    Ok(())
}

/// `pgbus metrics`: serves the gauges of every subscription, sampled every `--interval`.
pub(crate) async fn run(args: MetricsArgs, url: Option<&str>) -> Result<(), Failure> {
    let config = super::database_config(url)?;
    let mut signals = StopSignals::catch()?;
    let mut client = Some(super::connect(&config).await?);
    serve(args.listen)?;
    eprintln!(
        "pgbus: serving metrics on http://{}/metrics, sampled every {}; stop with Ctrl-C or SIGTERM",
        args.listen,
        human_duration(args.interval)
    );
    let mut tick = tokio::time::interval(args.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = signals.recv() => return Ok(()),
            _ = tick.tick() => {}
        }
        if client
            .as_ref()
            .is_none_or(tokio_postgres::Client::is_closed)
        {
            client = match super::connect(&config).await {
                Ok(c) => Some(c),
                Err(f) => {
                    pgbus::warn_limited!(error = %f.message, "pgbus metrics cannot reach the database");
                    None
                }
            };
        }
        let Some(c) = &client else { continue };
        let sampled = async {
            let backlog = pgbus::admin::backlog(c, None).await?;
            let fan_out = pgbus::admin::fan_out_backlog(c).await?;
            Ok::<_, pgbus::Error>((backlog, fan_out, pgbus::admin::xmin_horizon(c).await?))
        };
        match sampled.await {
            Ok((subscriptions, fan_out, horizon)) => {
                subscriptions
                    .iter()
                    .for_each(pgbus::metrics::Backlog::record);
                fan_out.record();
                horizon.record();
            }
            Err(e) => {
                pgbus::warn_limited!(error = %super::with_sources(&e), "pgbus metrics could not sample the gauges");
                client = None;
            }
        }
    }
}
