//! `pgbus replay`: deliver events still in the log to a subscription again.

use pgbus::admin;
use serde_json::json;

use super::output::plural;
use super::{Failure, TimeArg, parse_time, print_json};

/// Arguments of `pgbus replay`.
#[derive(Debug, clap::Args)]
#[command(after_help = "\
Examples:
  pgbus replay --subscription search --since 2h
  pgbus replay -s search --since 2025-01-31T00:00:00Z --until 2025-02-01T00:00:00Z
  pgbus replay -s mailer --since 1d --pattern order.placed

TIME is an RFC 3339 timestamp, a date (midnight UTC), or a duration ago by the
database's clock (30m, 2h, 7d). Only events still in the log can be replayed (see
`pgbus sweep`); events the subscription still has a delivery of are skipped.

Needs the operator grant (as the schema's owner: SELECT pgbus.grant_operator('ROLE')).")]
pub(crate) struct ReplayArgs {
    /// The subscription to deliver to again.
    #[arg(long, short)]
    subscription: String,
    /// Events published at or after this time.
    #[arg(long, value_name = "TIME", value_parser = parse_time)]
    since: TimeArg,
    /// Events published before this time [default: now].
    #[arg(long, value_name = "TIME", value_parser = parse_time)]
    until: Option<TimeArg>,
    /// Only events that also match this pattern (within the subscription's own).
    #[arg(long, short)]
    pattern: Option<String>,
    /// Print a JSON object.
    #[arg(long)]
    json: bool,
}

pub(crate) async fn replay(args: ReplayArgs, url: Option<&str>) -> Result<(), Failure> {
    let client = super::connect_url(url).await?;
    let since = args.since.resolve(&client).await?;
    let until = match args.until {
        Some(t) => Some(t.resolve(&client).await?),
        None => None,
    };
    let replayed = admin::replay(
        &client,
        &args.subscription,
        since,
        until,
        args.pattern.as_deref(),
    )
    .await?;
    if args.json {
        print_json(&json!({
            "subscription": args.subscription,
            "matched": replayed.matched,
            "created": replayed.created,
        }))?;
    } else {
        outln!(
            "replayed {} event{} to {:?} ({} matched, {} skipped: already delivering)",
            replayed.created,
            plural(replayed.created),
            args.subscription,
            replayed.matched,
            replayed.matched - replayed.created
        )?;
    }
    Ok(())
}
