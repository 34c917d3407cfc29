//! `pgbus subscriptions`: list, change, pause, resume or drop subscriptions.

use pgbus::admin;
use serde_json::json;

use super::output::{plural, timestamp};
use super::{Failure, failed, parse_duration, print_json, table, usage};

/// `pgbus subscriptions`: list, change, pause, resume or drop subscriptions.
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
    /// Pause a subscription: its consumers take none of its deliveries until it is resumed.
    #[command(after_help = "\
Example:
  pgbus subscriptions pause mailer

Publishing goes on: its deliveries are made and wait. What its consumers hold now is
settled as usual; they stay connected and claim nothing of it. `pgbus status` and
`subscriptions list` show it as paused, and the gauge pgbus_subscription_paused reads 1.
Pausing a paused subscription changes nothing.

Needs the operator grant (as the schema's owner: SELECT pgbus.grant_operator('ROLE')).")]
    Pause {
        /// The subscription.
        name: String,
        /// Print a JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Resume a paused subscription: what waited is delivered at once.
    #[command(after_help = "\
Example:
  pgbus subscriptions resume mailer

Its consumers are notified and claim what waited, oldest first; an ordered subscription
goes on from each key's head, in order. Resuming a subscription that is not paused
changes nothing.

Needs the operator grant (as the schema's owner: SELECT pgbus.grant_operator('ROLE')).")]
    Resume {
        /// The subscription.
        name: String,
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
        SubscriptionsCommand::List { json } => list(&client, json).await,
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
            set(&client, &name, &change, wait, json).await
        }
        SubscriptionsCommand::Pause { name, json } => pause(&client, &name, json).await,
        SubscriptionsCommand::Resume { name, json } => resume(&client, &name, json).await,
        SubscriptionsCommand::Drop { name, force, json } => {
            drop_one(&client, &name, force, json).await
        }
    }
}

/// `pgbus subscriptions pause`.
async fn pause(client: &tokio_postgres::Client, name: &str, json: bool) -> Result<(), Failure> {
    let paused = admin::pause_subscription(client, name).await?;
    if json {
        return print_json(&json!({
            "subscription": name,
            "paused_since": paused.since,
            "already": paused.already,
        }));
    }
    if paused.already {
        outln!(
            "subscription {name:?} was already paused (since {})",
            timestamp(paused.since)
        )
    } else {
        outln!(
            "paused subscription {name:?}: its deliveries wait until `pgbus subscriptions resume {name}`"
        )
    }
}

/// `pgbus subscriptions resume`.
async fn resume(client: &tokio_postgres::Client, name: &str, json: bool) -> Result<(), Failure> {
    let resumed = admin::resume_subscription(client, name).await?;
    if json {
        return print_json(&json!({
            "subscription": name,
            "resumed": resumed.paused_since.is_some(),
            "paused_since": resumed.paused_since,
        }));
    }
    match resumed.paused_since {
        Some(since) => outln!(
            "resumed subscription {name:?} (paused since {}); its consumers are notified",
            timestamp(since)
        ),
        None => outln!("subscription {name:?} was not paused"),
    }
}

/// `pgbus subscriptions list`.
async fn list(client: &tokio_postgres::Client, json: bool) -> Result<(), Failure> {
    let subs = admin::subscriptions(client).await?;
    if json {
        return print_json(&subs);
    }
    if subs.is_empty() {
        return outln!("no subscriptions yet");
    }
    let rows: Vec<Vec<String>> = subs
        .iter()
        .map(|s| {
            vec![
                s.name.clone(),
                s.patterns.join(","),
                s.max_attempts.to_string(),
                s.consumers.to_string(),
                timestamp(s.created_at),
                s.paused_at.map_or_else(|| "-".to_owned(), timestamp),
            ]
        })
        .collect();
    let header = [
        "NAME",
        "PATTERNS",
        "MAX ATTEMPTS",
        "CONSUMERS",
        "CREATED",
        "PAUSED SINCE",
    ];
    out!("{}", table(&header, &rows))
}

/// `pgbus subscriptions set`: the change, then the settings in force.
async fn set(
    client: &tokio_postgres::Client,
    name: &str,
    change: &admin::SubscriptionChange,
    wait: std::time::Duration,
    json: bool,
) -> Result<(), Failure> {
    if *change == admin::SubscriptionChange::new() {
        return Err(usage(
            "error: nothing to change: give --pattern, --max-attempts, --ordered, \
             --unordered or --on-dead",
        ));
    }
    let Some(converted) = admin::configure_subscription_within(client, name, change, wait).await?
    else {
        return Err(failed(format!("error: no subscription {name:?}")));
    };
    let settings = admin::subscription_settings(client, name)
        .await?
        .ok_or_else(|| failed(format!("error: subscription {name:?} was dropped")))?;
    let skip = settings.on_dead == pgbus::DeadHeadPolicy::Skip;
    if json {
        return print_json(&json!({
            "name": name,
            "patterns": settings.patterns,
            "max_attempts": settings.max_attempts,
            "ordered": settings.ordered,
            "on_dead": if skip { "skip" } else { "block" },
            "converted": converted,
        }));
    }
    let order = match (settings.ordered, skip) {
        (false, _) => "unordered",
        (true, true) => "ordered (dead heads skipped)",
        (true, false) => "ordered (dead heads block their key)",
    };
    outln!(
        "subscription {name:?}: patterns {}, max attempts {}, {order}; {converted} waiting deliver{} converted",
        settings.patterns.join(","),
        settings.max_attempts,
        if converted == 1 { "y" } else { "ies" }
    )
}

/// `pgbus subscriptions drop`.
async fn drop_one(
    client: &tokio_postgres::Client,
    name: &str,
    force: bool,
    json: bool,
) -> Result<(), Failure> {
    let dropped = match admin::drop_subscription(client, name, force).await {
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
        }))
    } else {
        outln!(
            "dropped subscription {name:?} ({} deliver{}, {} failure record{})",
            dropped.deliveries,
            if dropped.deliveries == 1 { "y" } else { "ies" },
            dropped.failures,
            plural(dropped.failures)
        )
    }
}
