//! `pgbus keys`: the blocked keys of ordered subscriptions.

use serde_json::json;

use super::{Failure, print_json, table};

/// Blocked keys of ordered subscriptions.
#[derive(Debug, clap::Subcommand)]
pub(crate) enum KeysCommand {
    /// List keys stopped behind a dead head (subscriptions consumed with --ordered and
    /// the default --on-dead block).
    #[command(after_help = "\
Examples:
  pgbus keys list
  pgbus keys list --subscription orders-view --json")]
    List {
        /// Only this subscription's keys.
        #[arg(long, short)]
        subscription: Option<String>,
        /// Print a JSON array.
        #[arg(long)]
        json: bool,
    },
    /// Retry a key's head now: a dead head gets its attempts back, a head backing off is
    /// due at once. The key resumes in order.
    #[command(
        after_help = "Examples:\n  pgbus keys redrive orders-view order:42\n  pgbus keys redrive orders-view order:42 --head order-42-shipped\n\nWith --head, only that event (as `keys list` showed it) is redriven: if the key's head\nis another now, nothing changes and the command fails naming it.\n\nNeeds the operator grant (as the schema's owner: SELECT pgbus.grant_operator('ROLE'))."
    )]
    Redrive {
        /// The subscription.
        subscription: String,
        /// The ordering key.
        key: String,
        /// Act only if the key's head is this event (its id).
        #[arg(long)]
        head: Option<String>,
    },
    /// Set a key's dead head aside (it stays in `pgbus dead list`) and let the key go on.
    #[command(
        after_help = "Examples:\n  pgbus keys skip orders-view order:42\n  pgbus keys skip orders-view order:42 --head order-42-shipped\n\nWith --head, only that event (as `keys list` showed it) is skipped: if the key's head is\nanother now, or no longer dead, nothing changes and the command fails naming it.\n\nNeeds the operator grant (as the schema's owner: SELECT pgbus.grant_operator('ROLE'))."
    )]
    Skip {
        /// The subscription.
        subscription: String,
        /// The ordering key.
        key: String,
        /// Act only if the key's dead head is this event (its id).
        #[arg(long)]
        head: Option<String>,
    },
}

pub(crate) async fn keys(command: KeysCommand, url: Option<&str>) -> Result<(), Failure> {
    let client = super::connect_url(url).await?;
    match command {
        KeysCommand::List { subscription, json } => {
            let blocked = pgbus::ordering::blocked_keys(&client, subscription.as_deref()).await?;
            if json {
                let items: Vec<_> = blocked
                    .iter()
                    .map(|k| {
                        json!({
                            "subscription": k.subscription,
                            "key": k.key,
                            "event_id": k.event_id,
                            "event_name": k.event_name,
                            "attempts": k.attempts,
                            "last_error": k.last_error,
                            "waiting": k.waiting,
                        })
                    })
                    .collect();
                print_json(&json!(items))?;
            } else if blocked.is_empty() {
                outln!("no blocked keys")?;
            } else {
                let rows: Vec<Vec<String>> = blocked
                    .iter()
                    .map(|k| {
                        vec![
                            k.subscription.clone(),
                            k.key.clone(),
                            k.waiting.to_string(),
                            k.event_id.clone(),
                            k.event_name.clone(),
                            k.attempts.to_string(),
                            k.last_error.clone().unwrap_or_default(),
                        ]
                    })
                    .collect();
                out!(
                    "{}",
                    table(
                        &[
                            "SUBSCRIPTION",
                            "KEY",
                            "WAITING",
                            "HEAD EVENT",
                            "NAME",
                            "ATTEMPTS",
                            "LAST ERROR"
                        ],
                        &rows
                    )
                )?;
            }
            Ok(())
        }
        KeysCommand::Redrive {
            subscription,
            key,
            head: Some(seen),
        } => {
            let outcome =
                pgbus::ordering::redrive_seen_head(&client, &subscription, &key, &seen).await?;
            seen_head(outcome, "redriven", &subscription, &key, &seen)
        }
        KeysCommand::Skip {
            subscription,
            key,
            head: Some(seen),
        } => {
            let outcome =
                pgbus::ordering::skip_seen_head(&client, &subscription, &key, &seen).await?;
            seen_head(outcome, "skipped", &subscription, &key, &seen)
        }
        KeysCommand::Redrive {
            subscription,
            key,
            head: None,
        } => {
            if pgbus::ordering::redrive_head(&client, &subscription, &key).await? {
                outln!("redriven: {subscription} {key}")?;
                Ok(())
            } else {
                Err(super::failed(format!(
                    "error: {subscription:?} has no dead or waiting head for key {key:?}"
                )))
            }
        }
        KeysCommand::Skip {
            subscription,
            key,
            head: None,
        } => {
            if pgbus::ordering::skip_head(&client, &subscription, &key).await? {
                outln!("skipped: {subscription} {key}")?;
                Ok(())
            } else {
                Err(super::failed(format!(
                    "error: {subscription:?} has no dead head for key {key:?}"
                )))
            }
        }
    }
}

/// The answer to `keys redrive|skip --head`: done, or the head it named is not the key's
/// head (in the state the action needs) any more, and nothing was done.
fn seen_head(
    outcome: pgbus::ordering::SeenHead,
    done: &str,
    subscription: &str,
    key: &str,
    seen: &str,
) -> Result<(), Failure> {
    match outcome {
        pgbus::ordering::SeenHead::Done { promoted } => match promoted {
            Some(next) => outln!("{done}: {subscription} {key} ({seen}); {next} is its head now"),
            None => outln!("{done}: {subscription} {key} ({seen})"),
        },
        other => Err(super::failed(match other.change_from(seen) {
            Some(now) => format!(
                "error: key {key:?} of {subscription:?} is not as given: {now}; nothing was done"
            ),
            None => format!("error: unexpected answer for key {key:?} of {subscription:?}"),
        })),
    }
}
