//! `pgbus status`: the state of every subscription, once or refreshed in place.

use std::fmt::Write as _;
use std::io::IsTerminal as _;
use std::time::Duration;

use pgbus::admin::{self, Status};
use serde_json::json;

use super::{Failure, human_duration, parse_duration, table};

/// Arguments of `pgbus status`.
#[derive(Debug, clap::Args)]
#[command(after_help = "\
Examples:
  pgbus status
  pgbus status --watch --interval 2s
  pgbus status --subscription mailer --json | jq '.subscriptions[0].dead'

Columns: PENDING waiting (due now or retries scheduled later), DUE pending and due now,
PROCESSING claimed by a consumer, DEAD dead letters, LAG how long the oldest due delivery
has waited, DONE/1M events of the last minute whose delivery finished (~N: estimated from
an even sample of a minute busier than 2,000 events), CONSUMERS running consumers serving
the subscription; (paused) after a name: its deliveries wait (`pgbus subscriptions
resume NAME`). Below: the notification queue, and the oldest transaction that holds the
xmin horizon back (a WARNING line past 5 minutes).")]
pub(crate) struct StatusArgs {
    /// Only this subscription.
    #[arg(long, short)]
    subscription: Option<String>,
    /// Refresh in place until Ctrl-C.
    #[arg(long, short)]
    watch: bool,
    /// How often --watch refreshes.
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    interval: Duration,
    /// Print JSON (with --watch, one object per line).
    #[arg(long)]
    json: bool,
}

pub(crate) async fn run(args: StatusArgs, url: Option<&str>) -> Result<(), Failure> {
    let client = super::connect_url(url).await?;
    if !args.watch {
        let status = read(&client, args.subscription.as_deref()).await?;
        return out!("{}", show(&status, args.json));
    }
    let in_place = !args.json && std::io::stdout().is_terminal();
    let mut tick = tokio::time::interval(args.interval.max(Duration::from_millis(100)));
    let stop = super::shutdown_signal()?;
    tokio::pin!(stop);
    loop {
        tokio::select! {
            () = &mut stop => return Ok(()),
            _ = tick.tick() => {}
        }
        let status = read(&client, args.subscription.as_deref()).await?;
        let mut view = show(&status, args.json);
        if in_place {
            // Home, clear: the view is redrawn in place.
            view.insert_str(0, "\x1b[H\x1b[2J");
        }
        // Written off the runtime's threads: a reader that stops reading blocks that
        // write, never the signals (the blocked thread is left behind at exit).
        let write = tokio::task::spawn_blocking(move || out!("{view}"));
        tokio::select! {
            () = &mut stop => return Ok(()),
            written = write => written
                .map_err(|e| super::failed(format!("error: writing standard output: {e}")))??,
        }
    }
}

async fn read(client: &tokio_postgres::Client, only: Option<&str>) -> Result<Status, Failure> {
    Ok(admin::status_of(client, only).await?)
}

/// The status as printed: a table, or one line of JSON.
fn show(status: &Status, as_json: bool) -> String {
    if as_json {
        let subs: Vec<_> = status
            .subscriptions
            .iter()
            .map(|s| {
                json!({
                    "name": s.name,
                    "patterns": s.patterns,
                    "max_attempts": s.max_attempts,
                    "pending": s.pending,
                    "due": s.due,
                    "processing": s.processing,
                    "dead": s.dead,
                    "blocked_keys": s.blocked_keys,
                    "lag_seconds": s.oldest_due_age.map(|d| d.as_secs_f64()),
                    "done_last_minute": s.done_last_minute,
                    "done_last_minute_estimated": s.done_estimated,
                    "consumers": s.consumers,
                    "paused_since": s.paused_at,
                })
            })
            .collect();
        let value = json!({
            "subscriptions": subs,
            "notification_queue_usage": status.notification_queue_usage,
            "listeners": status.listeners,
            "consumers": status.consumers,
            "sleeping_consumers": status.sleeping_consumers,
            "oldest_transaction_age_seconds": status.horizon.oldest_transaction_age,
            "oldest_transaction": status.horizon.oldest_transaction,
            "oldest_transaction_long": long_transaction(status),
            "replication_slot_xmin_age": status.horizon.slot_xmin_age,
            "not_fanned_out": status.fan_out.events,
            "not_fanned_out_oldest_age_seconds": status.fan_out.oldest_age,
        });
        return format!("{value}\n");
    }
    let mut text = String::new();
    let rows: Vec<Vec<String>> = status
        .subscriptions
        .iter()
        .map(|s| {
            vec![
                match s.paused_at {
                    Some(_) => format!("{} (paused)", s.name),
                    None => s.name.clone(),
                },
                s.pending.to_string(),
                s.due.to_string(),
                s.processing.to_string(),
                s.dead.to_string(),
                s.blocked_keys.to_string(),
                s.oldest_due_age.map_or("-".into(), human_duration),
                format!(
                    "{}{}",
                    if s.done_estimated { "~" } else { "" },
                    s.done_last_minute
                ),
                s.consumers.to_string(),
            ]
        })
        .collect();
    if rows.is_empty() {
        text.push_str(
            "no subscriptions yet (a consumer registers its subscription when it starts)\n",
        );
    } else {
        text.push_str(&table(
            &[
                "SUBSCRIPTION",
                "PENDING",
                "DUE",
                "PROCESSING",
                "DEAD",
                "BLOCKED",
                "LAG",
                "DONE/1M",
                "CONSUMERS",
            ],
            &rows,
        ));
    }
    let _ = writeln!(
        text,
        "notification queue {:.1}% used, {} listener{}, {} consumer{} ({} asleep)",
        status.notification_queue_usage * 100.0,
        status.listeners,
        plural(status.listeners),
        status.consumers,
        plural(status.consumers),
        status.sleeping_consumers,
    );
    match status.fan_out.oldest_age {
        Some(age) if status.fan_out.events > 0 => {
            let _ = writeln!(
                text,
                "{} event{} committed and not yet turned into deliveries, the oldest {} old{}",
                status.fan_out.events,
                plural(status.fan_out.events),
                human_duration(Duration::from_secs_f64(age)),
                if status.fan_out.events >= pgbus::metrics::GAUGE_COUNT_CAP {
                    " (counted up to there)"
                } else {
                    ""
                },
            );
        }
        _ => {}
    }
    let horizon = &status.horizon;
    match (horizon.oldest_transaction_age, &horizon.oldest_transaction) {
        (Some(age), Some(holder)) => {
            let _ = write!(
                text,
                "xmin horizon held for {} by {holder}",
                human_duration(Duration::from_secs_f64(age))
            );
        }
        _ => text.push_str("xmin horizon: no open transaction holds it"),
    }
    if let Some(age) = horizon.slot_xmin_age {
        let _ = write!(
            text,
            "; a replication slot holds an xmin {age} transactions old"
        );
    }
    text.push('\n');
    if long_transaction(status) {
        let _ = writeln!(
            text,
            "WARNING: a long transaction: VACUUM cannot remove settled deliveries until it \
             ends, and claims slow down (end it; see docs/operations.md, \"A long transaction\")"
        );
    }
    text
}

/// Whether the oldest transaction holding the xmin horizon is older than
/// [`DEFAULT_LONG_TRANSACTION_WARNING`](pgbus::metrics::DEFAULT_LONG_TRANSACTION_WARNING).
fn long_transaction(status: &Status) -> bool {
    status
        .horizon
        .older_than(pgbus::metrics::DEFAULT_LONG_TRANSACTION_WARNING)
}

fn plural(n: i64) -> &'static str {
    if n == 1 { "" } else { "s" }
}
