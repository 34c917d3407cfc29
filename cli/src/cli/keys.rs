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
        after_help = "Example:\n  pgbus keys redrive orders-view order:42\n\nNeeds the operator grant (as the schema's owner: SELECT pgbus.grant_operator('ROLE'))."
    )]
    Redrive {
        /// The subscription.
        subscription: String,
        /// The ordering key.
        key: String,
    },
    /// Set a key's dead head aside (it stays in `pgbus dead list`) and let the key go on.
    #[command(
        after_help = "Example:\n  pgbus keys skip orders-view order:42\n\nNeeds the operator grant (as the schema's owner: SELECT pgbus.grant_operator('ROLE'))."
    )]
    Skip {
        /// The subscription.
        subscription: String,
        /// The ordering key.
        key: String,
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
        KeysCommand::Redrive { subscription, key } => {
            if pgbus::ordering::redrive_head(&client, &subscription, &key).await? {
                outln!("redriven: {subscription} {key}")?;
                Ok(())
            } else {
                Err(super::failed(format!(
                    "error: {subscription:?} has no dead or waiting head for key {key:?}"
                )))
            }
        }
        KeysCommand::Skip { subscription, key } => {
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
