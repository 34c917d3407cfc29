//! `pgbus sweep`: the retention sweep, by hand.

use std::time::Duration;

use pgbus::admin;
use serde_json::json;

use super::output::plural;
use super::{Failure, parse_duration, print_json};

/// Arguments of `pgbus sweep`.
#[derive(Debug, clap::Args)]
#[command(after_help = "\
Examples:
  pgbus sweep
  pgbus sweep --retention 30d --json

Deletes events older than the retention that no delivery still needs (completed, or
never matched), with their failure history, in batches. Dead letters and pending
deliveries keep their events. Running buses do this hourly by themselves; at most one
sweep runs at a time.")]
pub(crate) struct SweepArgs {
    /// Keep events at least this long.
    #[arg(long, default_value = "7d", value_parser = parse_duration)]
    retention: Duration,
    /// Events deleted per batch (each batch is its own transaction).
    #[arg(long, default_value_t = admin::DEFAULT_SWEEP_BATCH)]
    batch: i32,
    /// Print a JSON object.
    #[arg(long)]
    json: bool,
}

pub(crate) async fn sweep(args: SweepArgs, url: Option<&str>) -> Result<(), Failure> {
    let client = super::connect_url(url).await?;
    let swept = admin::sweep(&client, args.retention, args.batch).await?;
    if args.json {
        print_json(&json!({
            "events": swept.events,
            "failures": swept.failures,
            "batches": swept.batches,
            "busy": swept.busy,
        }))?;
    } else {
        outln!(
            "swept {} event{} and {} failure record{} in {} batch{}",
            swept.events,
            plural(swept.events),
            swept.failures,
            plural(swept.failures),
            swept.batches,
            if swept.batches == 1 { "" } else { "es" }
        )?;
        if swept.busy {
            outln!("another sweep is running; it will delete the rest")?;
        }
    }
    Ok(())
}
