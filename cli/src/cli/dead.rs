//! `pgbus dead`: list dead letters page by page, retry or purge them.

use std::io::{BufRead as _, IsTerminal as _, Write as _};

use pgbus::admin::{self, DeadLetterFilter};
use serde_json::json;

use super::output::{one_line, plural, timestamp};
use super::{Failure, failed, print_json, table, usage};

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
        } => list(&client, subscription, event, limit, after.as_deref(), json).await,
        DeadCommand::Retry {
            which,
            subscription,
            json,
        } => retry(&client, &which, subscription.as_deref(), json).await,
        DeadCommand::Purge {
            which,
            subscription,
            yes,
            json,
        } => purge(&client, &which, subscription.as_deref(), yes, json).await,
    }
}

/// `pgbus dead list`: one page, and the command for the next.
async fn list(
    client: &tokio_postgres::Client,
    subscription: Option<String>,
    event: Option<String>,
    limit: i64,
    after: Option<&str>,
    json: bool,
) -> Result<(), Failure> {
    if limit < 1 {
        return Err(usage("error: --limit must be at least 1"));
    }
    let after: Option<admin::DeadLetterCursor> = after.map(str::parse).transpose()?;
    let mut filter = DeadLetterFilter::all();
    if let Some(s) = subscription {
        filter = filter.subscription(s);
    }
    if let Some(e) = event {
        filter = filter.event_id(e);
    }
    let dead = admin::dead_letters_after(client, &filter, limit, after.as_ref()).await?;
    if json {
        return print_json(&dead);
    }
    if dead.is_empty() {
        return outln!("no dead letters");
    }
    let next = dead.last().map(admin::DeadLetter::cursor);
    let more = match (&next, dead.len() as i64 == limit) {
        (Some(next), true) => admin::count_dead_letters_after(client, &filter, Some(next)).await?,
        _ => 0,
    };
    let rows: Vec<Vec<String>> = dead
        .iter()
        .map(|d| {
            vec![
                d.subscription.clone(),
                d.event_id.clone().unwrap_or_else(|| "-".into()),
                d.event_name.clone().unwrap_or_else(|| "-".into()),
                d.attempts.to_string(),
                d.failed_at.map_or("-".into(), timestamp),
                one_line(d.last_error.as_deref().unwrap_or("-"), 60),
            ]
        })
        .collect();
    let header = [
        "SUBSCRIPTION",
        "EVENT ID",
        "NAME",
        "ATTEMPTS",
        "FAILED AT",
        "LAST ERROR",
    ];
    out!("{}", table(&header, &rows))?;
    if let (Some(next), true) = (next, more > 0) {
        outln!("{more} more: pgbus dead list --after {next} (with the same filters)")?;
    }
    Ok(())
}

/// `pgbus dead retry`.
async fn retry(
    client: &tokio_postgres::Client,
    which: &Which,
    subscription: Option<&str>,
    json: bool,
) -> Result<(), Failure> {
    let retried = admin::retry_dead_letters(client, &which.filter(subscription)).await?;
    if retried == 0
        && let Some(f) = which.none_matched(subscription)
    {
        return Err(f);
    }
    if json {
        print_json(&json!({ "retried": retried }))
    } else {
        outln!("retried {retried} dead letter{}", plural(retried))
    }
}

/// `pgbus dead purge`: asks first, unless `yes`.
async fn purge(
    client: &tokio_postgres::Client,
    which: &Which,
    subscription: Option<&str>,
    yes: bool,
    json: bool,
) -> Result<(), Failure> {
    let filter = which.filter(subscription);
    if !yes {
        let n = admin::count_dead_letters(client, &filter).await?;
        if n > 0 && !confirm(&format!("purge {n} dead letter{}?", plural(n as u64)))? {
            return Err(failed("pgbus: nothing purged"));
        }
    }
    let purged = admin::purge_dead_letters(client, &filter).await?;
    if purged.dead_letters == 0
        && let Some(f) = which.none_matched(subscription)
    {
        return Err(f);
    }
    if json {
        print_json(&json!({
            "purged": purged.dead_letters,
            "failures": purged.failures,
        }))
    } else {
        outln!(
            "purged {} dead letter{} and {} failure record{}",
            purged.dead_letters,
            plural(purged.dead_letters),
            purged.failures,
            plural(purged.failures)
        )
    }
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
