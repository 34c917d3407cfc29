//! The operator's commands: `dead`, `replay`, `subscriptions` and `sweep`.

use std::io::{BufRead as _, IsTerminal as _, Write as _};
use std::time::Duration;

use pgbus::admin::{self, DeadLetterFilter};
use serde_json::json;

use super::{Failure, TimeArg, failed, parse_duration, parse_time, print_json, table, usage};

/// `pgbus dead`: list, retry or purge dead letters.
#[derive(Debug, clap::Subcommand)]
pub(crate) enum DeadCommand {
    /// List dead letters: event id, name, attempts, last error, when.
    #[command(after_help = "\
Examples:
  pgbus dead list
  pgbus dead list --subscription mailer --json | jq -r '.[].event_id'")]
    List {
        /// Only this subscription's.
        #[arg(long, short)]
        subscription: Option<String>,
        /// Only this event's.
        #[arg(long, value_name = "ID")]
        event: Option<String>,
        /// The most to list (a page).
        #[arg(long, default_value_t = 100)]
        limit: i64,
        /// List the page after this place (SEQ/SUBSCRIPTION, as the previous page says).
        #[arg(long, value_name = "SEQ/SUBSCRIPTION")]
        after: Option<String>,
        /// Print a JSON array.
        #[arg(long)]
        json: bool,
    },
    /// Put dead letters back to pending, due now, with attempts reset; history is kept.
    #[command(after_help = "\
Examples:
  pgbus dead retry --all
  pgbus dead retry --all --subscription mailer
  pgbus dead retry --event 0197a5c2-8f0e-7b5e-9d4f-2f6c1e0a9b31

Needs the operator grant (as the schema's owner: SELECT pgbus.grant_operator('ROLE')).")]
    Retry {
        #[command(flatten)]
        which: Which,
        /// Only this subscription's.
        #[arg(long, short)]
        subscription: Option<String>,
        /// Print a JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Delete dead letters and their failure history for good.
    #[command(after_help = "\
Examples:
  pgbus dead purge --all --subscription mailer --yes
  pgbus dead purge --event 0197a5c2-8f0e-7b5e-9d4f-2f6c1e0a9b31

Without --yes it asks for confirmation, and refuses when standard input is not a
terminal.

Needs the operator grant (as the schema's owner: SELECT pgbus.grant_operator('ROLE')).")]
    Purge {
        #[command(flatten)]
        which: Which,
        /// Only this subscription's.
        #[arg(long, short)]
        subscription: Option<String>,
        /// Do not ask for confirmation.
        #[arg(long, short)]
        yes: bool,
        /// Print a JSON object.
        #[arg(long)]
        json: bool,
    },
}

/// Which dead letters `retry` and `purge` apply to.
#[derive(Debug, clap::Args)]
#[group(id = "which_dead", required = true, multiple = false)]
pub(crate) struct Which {
    /// Every dead letter (of --subscription, if given).
    #[arg(long)]
    all: bool,
    /// The dead letters of this event (one per subscription, or of --subscription).
    #[arg(long, value_name = "ID")]
    event: Option<String>,
}

impl Which {
    fn filter(&self, subscription: Option<&str>) -> DeadLetterFilter {
        let mut filter = DeadLetterFilter::all();
        if let Some(s) = subscription {
            filter = filter.subscription(s);
        }
        if let Some(e) = &self.event {
            filter = filter.event_id(e.clone());
        }
        filter
    }

    fn none_matched(&self, subscription: Option<&str>) -> Option<Failure> {
        self.event.as_ref().map(|id| {
            failed(format!(
                "error: event {id:?} has no dead letter{}",
                subscription
                    .map(|s| format!(" in subscription {s:?}"))
                    .unwrap_or_default()
            ))
        })
    }
}

pub(crate) async fn dead(command: DeadCommand, url: Option<&str>) -> Result<(), Failure> {
    let client = super::connect_url(url).await?;
    match command {
        DeadCommand::List {
            subscription,
            event,
            limit,
            after,
            json,
        } => {
            if limit < 1 {
                return Err(usage("error: --limit must be at least 1"));
            }
            let after: Option<admin::DeadLetterCursor> =
                after.as_deref().map(str::parse).transpose()?;
            let mut filter = DeadLetterFilter::all();
            if let Some(s) = subscription {
                filter = filter.subscription(s);
            }
            if let Some(e) = event {
                filter = filter.event_id(e);
            }
            let dead = admin::dead_letters_after(&client, &filter, limit, after.as_ref()).await?;
            let next = dead.last().map(admin::DeadLetter::cursor);
            let more = match (&next, dead.len() as i64 == limit) {
                (Some(next), true) => {
                    admin::count_dead_letters_after(&client, &filter, Some(next)).await?
                }
                _ => 0,
            };
            if json {
                let items: Vec<_> = dead
                    .iter()
                    .map(|d| {
                        json!({
                            "subscription": d.subscription,
                            "event_seq": d.event_seq,
                            "event_id": d.event_id,
                            "event_name": d.event_name,
                            "attempts": d.attempts,
                            "last_error": d.last_error,
                            "failed_at": d.failed_at,
                        })
                    })
                    .collect();
                print_json(&json!(items))?;
            } else if dead.is_empty() {
                outln!("no dead letters")?;
            } else {
                let rows: Vec<Vec<String>> = dead
                    .iter()
                    .map(|d| {
                        vec![
                            d.subscription.clone(),
                            d.event_id.clone().unwrap_or_else(|| "-".into()),
                            d.event_name.clone().unwrap_or_else(|| "-".into()),
                            d.attempts.to_string(),
                            d.failed_at
                                .map_or("-".into(), |t| t.format("%Y-%m-%d %H:%M:%SZ").to_string()),
                            one_line(d.last_error.as_deref().unwrap_or("-"), 60),
                        ]
                    })
                    .collect();
                out!(
                    "{}",
                    table(
                        &[
                            "SUBSCRIPTION",
                            "EVENT ID",
                            "NAME",
                            "ATTEMPTS",
                            "FAILED AT",
                            "LAST ERROR"
                        ],
                        &rows
                    )
                )?;
                if let (Some(next), true) = (next, more > 0) {
                    outln!("{more} more: pgbus dead list --after {next} (with the same filters)")?;
                }
            }
        }
        DeadCommand::Retry {
            which,
            subscription,
            json,
        } => {
            let subscription = subscription.as_deref();
            let retried = admin::retry_dead_letters(&client, &which.filter(subscription)).await?;
            if retried == 0
                && let Some(f) = which.none_matched(subscription)
            {
                return Err(f);
            }
            if json {
                print_json(&json!({ "retried": retried }))?;
            } else {
                outln!("retried {retried} dead letter{}", plural(retried))?;
            }
        }
        DeadCommand::Purge {
            which,
            subscription,
            yes,
            json,
        } => {
            let subscription = subscription.as_deref();
            let filter = which.filter(subscription);
            if !yes {
                let n = admin::count_dead_letters(&client, &filter).await?;
                if n > 0 && !confirm(&format!("purge {n} dead letter{}?", plural(n as u64)))? {
                    return Err(failed("pgbus: nothing purged"));
                }
            }
            let purged = admin::purge_dead_letters(&client, &filter).await?;
            if purged.dead_letters == 0
                && let Some(f) = which.none_matched(subscription)
            {
                return Err(f);
            }
            if json {
                print_json(&json!({
                    "purged": purged.dead_letters,
                    "failures": purged.failures,
                }))?;
            } else {
                outln!(
                    "purged {} dead letter{} and {} failure record{}",
                    purged.dead_letters,
                    plural(purged.dead_letters),
                    purged.failures,
                    plural(purged.failures)
                )?;
            }
        }
    }
    Ok(())
}

/// Asks on the terminal; refuses when standard input is not one.
fn confirm(question: &str) -> Result<bool, Failure> {
    if !std::io::stdin().is_terminal() {
        return Err(usage(format!(
            "error: {question} pass --yes to confirm (standard input is not a terminal)"
        )));
    }
    eprint!("{question} [y/N] ");
    let _ = std::io::stderr().flush();
    let mut answer = String::new();
    std::io::stdin()
        .lock()
        .read_line(&mut answer)
        .map_err(|e| failed(format!("error: reading the answer: {e}")))?;
    Ok(matches!(answer.trim(), "y" | "Y" | "yes"))
}

/// The text on one line (line breaks and tabs as spaces), cut at `max` characters; the
/// table escapes what else a terminal would interpret.
fn one_line(text: &str, max: usize) -> String {
    let flat: String = text
        .chars()
        .map(|c| {
            if matches!(c, '\n' | '\r' | '\t') {
                ' '
            } else {
                c
            }
        })
        .collect();
    if flat.chars().count() > max {
        format!("{}...", flat.chars().take(max).collect::<String>())
    } else {
        flat
    }
}

fn plural(n: u64) -> &'static str {
    if n == 1 { "" } else { "s" }
}

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

/// `pgbus subscriptions`: list or drop subscriptions.
#[derive(Debug, clap::Subcommand)]
pub(crate) enum SubscriptionsCommand {
    /// List the registered subscriptions.
    #[command(after_help = "Example:\n  pgbus subscriptions list --json")]
    List {
        /// Print a JSON array.
        #[arg(long)]
        json: bool,
    },
    /// Drop a subscription with its deliveries and their failure history.
    #[command(after_help = "\
Examples:
  pgbus subscriptions drop old-projection
  pgbus subscriptions drop old-projection --force

Refuses while deliveries of it are processing, unless --force. Stop its consumers first:
a consumer registers its subscription again when it starts.

Only the schema's owner (the role that ran `pgbus migrate`) may drop a subscription.")]
    Drop {
        /// The subscription.
        name: String,
        /// Drop it even while deliveries are processing.
        #[arg(long)]
        force: bool,
        /// Print a JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Change a subscription's settings for every consumer of it.
    #[command(after_help = "\
Examples:
  pgbus subscriptions set ship --ordered --on-dead skip
  pgbus subscriptions set ship --unordered
  pgbus subscriptions set audit --pattern 'order.*' --pattern 'invoice.*' --max-attempts 10

Safe while publishers and consumers run: it waits for the publishes and settlements that
read the old settings, and converts the backlog in the same transaction. --ordered gives
each key one head, its oldest waiting delivery (deliveries already processing finish,
or are retried, unordered; dead letters stay aside until retried). --unordered makes every waiting
delivery claimable at once. New patterns apply to events published from then on.
Consumers started without these options follow the stored settings.

The change needs the configuration lock to itself, so it waits for transactions that
published or settled under the old settings. It tries for 200 ms at a time, letting
other publishes and settlements through in between, warns naming the sessions it waits
on (pid, role, application_name, transaction age), and gives up after --wait, changing
nothing.

Needs the operator grant (as the schema's owner: SELECT pgbus.grant_operator('ROLE')).")]
    Set {
        /// The subscription.
        name: String,
        /// New event-name patterns (repeatable; replaces the stored ones).
        #[arg(long = "pattern", short)]
        patterns: Vec<String>,
        /// Attempts before a delivery becomes a dead letter.
        #[arg(long)]
        max_attempts: Option<i32>,
        /// Deliver each ordering key's events one at a time, in commit order.
        #[arg(long, conflicts_with = "unordered")]
        ordered: bool,
        /// Deliver events in any order.
        #[arg(long)]
        unordered: bool,
        /// What a key's dead head does in an ordered subscription.
        #[arg(long, value_enum)]
        on_dead: Option<super::consume::OnDead>,
        /// How long to wait for open transactions that read the old settings (e.g. 30s,
        /// 2m); then give up, changing nothing.
        #[arg(long, default_value = "30s", value_parser = parse_duration)]
        wait: std::time::Duration,
        /// Print a JSON object.
        #[arg(long)]
        json: bool,
    },
}

pub(crate) async fn subscriptions(
    command: SubscriptionsCommand,
    url: Option<&str>,
) -> Result<(), Failure> {
    let client = super::connect_url(url).await?;
    match command {
        SubscriptionsCommand::List { json } => {
            let subs = admin::subscriptions(&client).await?;
            if json {
                let items: Vec<_> = subs
                    .iter()
                    .map(|s| {
                        json!({
                            "name": s.name,
                            "patterns": s.patterns,
                            "max_attempts": s.max_attempts,
                            "created_at": s.created_at,
                            "updated_at": s.updated_at,
                            "consumers": s.consumers,
                        })
                    })
                    .collect();
                print_json(&json!(items))?;
            } else if subs.is_empty() {
                outln!("no subscriptions yet")?;
            } else {
                let rows: Vec<Vec<String>> = subs
                    .iter()
                    .map(|s| {
                        vec![
                            s.name.clone(),
                            s.patterns.join(","),
                            s.max_attempts.to_string(),
                            s.consumers.to_string(),
                            s.created_at.format("%Y-%m-%d %H:%M:%SZ").to_string(),
                        ]
                    })
                    .collect();
                out!(
                    "{}",
                    table(
                        &["NAME", "PATTERNS", "MAX ATTEMPTS", "CONSUMERS", "CREATED"],
                        &rows
                    )
                )?;
            }
        }
        SubscriptionsCommand::Set {
            name,
            patterns,
            max_attempts,
            ordered,
            unordered,
            on_dead,
            wait,
            json,
        } => {
            let mut change = admin::SubscriptionChange::new();
            if !patterns.is_empty() {
                change = change.patterns(patterns);
            }
            if let Some(n) = max_attempts {
                change = change.max_attempts(n);
            }
            if ordered || unordered {
                change = change.ordered(ordered);
            }
            if let Some(on_dead) = on_dead {
                change = change.on_dead(on_dead.policy());
            }
            if change == admin::SubscriptionChange::new() {
                return Err(usage(
                    "error: nothing to change: give --pattern, --max-attempts, --ordered, \
                     --unordered or --on-dead",
                ));
            }
            let Some(converted) =
                admin::configure_subscription_within(&client, &name, &change, wait).await?
            else {
                return Err(failed(format!("error: no subscription {name:?}")));
            };
            let settings = admin::subscription_settings(&client, &name)
                .await?
                .ok_or_else(|| failed(format!("error: subscription {name:?} was dropped")))?;
            if json {
                print_json(&json!({
                    "name": name,
                    "patterns": settings.patterns,
                    "max_attempts": settings.max_attempts,
                    "ordered": settings.ordered,
                    "on_dead": if settings.on_dead == pgbus::DeadHeadPolicy::Skip { "skip" } else { "block" },
                    "converted": converted,
                }))?;
            } else {
                outln!(
                    "subscription {name:?}: patterns {}, max attempts {}, {}{}; {converted} waiting deliver{} converted",
                    settings.patterns.join(","),
                    settings.max_attempts,
                    if settings.ordered {
                        "ordered"
                    } else {
                        "unordered"
                    },
                    if settings.ordered {
                        if settings.on_dead == pgbus::DeadHeadPolicy::Skip {
                            " (dead heads skipped)"
                        } else {
                            " (dead heads block their key)"
                        }
                    } else {
                        ""
                    },
                    if converted == 1 { "y" } else { "ies" }
                )?;
            }
        }
        SubscriptionsCommand::Drop { name, force, json } => {
            let dropped = match admin::drop_subscription(&client, &name, force).await {
                Err(pgbus::Error::SubscriptionBusy { name, processing }) => {
                    return Err(failed(format!(
                        "error: subscription {name:?} has {processing} deliveries processing; \
                         stop its consumers, or pass --force"
                    )));
                }
                other => other?,
            };
            if json {
                print_json(&json!({
                    "dropped": name,
                    "deliveries": dropped.deliveries,
                    "failures": dropped.failures,
                }))?;
            } else {
                outln!(
                    "dropped subscription {name:?} ({} deliver{}, {} failure record{})",
                    dropped.deliveries,
                    if dropped.deliveries == 1 { "y" } else { "ies" },
                    dropped.failures,
                    plural(dropped.failures)
                )?;
            }
        }
    }
    Ok(())
}

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
