//! `pgbus publish`: publish one event, or many from standard input in one transaction.

use std::io::Read as _;
use std::time::Duration;

use pgbus::{Event, Published};
use serde_json::{Value, json};

use super::{Failure, parse_duration, print_json, usage};

/// Arguments of `pgbus publish`.
#[derive(Debug, clap::Args)]
#[command(after_help = "\
Examples:
  pgbus publish order.placed '{\"order_id\": 42}' --aggregate order:42
  pgbus publish order.placed '{\"order_id\": 42}' --id order-42-placed --header tenant=acme
  pgbus publish reminder.due '{}' --delay 30m
  echo '{\"order_id\": 43}' | pgbus publish order.placed -
  jq -c '.orders[]' orders.json | pgbus publish order.imported - --lines

Prints the id of each event published. An event whose id is already in the log with the
same content is not published twice; with different content the command fails and
writes nothing.")]
pub(crate) struct PublishArgs {
    /// The event's name, e.g. order.placed.
    name: String,
    /// The payload: a JSON document, or - to read it from standard input [default: {}].
    payload: Option<String>,
    /// Read one JSON document per line of standard input: one event each, all published
    /// in one transaction (needs - as the payload).
    #[arg(long)]
    lines: bool,
    /// The event id: the idempotency key [default: a new UUIDv7].
    #[arg(long, conflicts_with = "lines")]
    id: Option<String>,
    /// The entity the event is about, as TYPE:ID (e.g. order:42).
    #[arg(long, value_name = "TYPE:ID", value_parser = parse_aggregate)]
    aggregate: Option<(String, String)>,
    /// The correlation id shared by everything one request caused.
    #[arg(long)]
    correlation_id: Option<String>,
    /// The id of the event or command that caused this one.
    #[arg(long)]
    causation_id: Option<String>,
    /// The service or component that emits the event.
    #[arg(long)]
    source: Option<String>,
    /// Deliver no earlier than this long after the commit (e.g. 30s, 5m).
    #[arg(long, value_parser = parse_duration)]
    delay: Option<Duration>,
    /// A header, as KEY=VALUE (repeatable); the value is a JSON string.
    #[arg(long = "header", value_name = "KEY=VALUE", value_parser = parse_header)]
    headers: Vec<(String, String)>,
    /// Print a JSON object instead of the bare ids.
    #[arg(long)]
    json: bool,
}

fn parse_aggregate(text: &str) -> Result<(String, String), String> {
    match text.split_once(':') {
        Some((kind, id)) if !kind.is_empty() && !id.is_empty() => {
            Ok((kind.to_string(), id.to_string()))
        }
        _ => Err(format!("expected TYPE:ID (e.g. order:42), got {text:?}")),
    }
}

fn parse_header(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((key, value)) if !key.is_empty() => Ok((key.to_string(), value.to_string())),
        _ => Err(format!("expected KEY=VALUE, got {text:?}")),
    }
}

fn parse_json(text: &str, what: &str) -> Result<Value, Failure> {
    serde_json::from_str(text).map_err(|e| usage(format!("error: invalid {what}: {e}")))
}

impl PublishArgs {
    fn event(&self, payload: Value) -> Event {
        let mut event = Event::new(self.name.clone(), payload);
        if let Some(id) = &self.id {
            event = event.id(id.clone());
        }
        if let Some((kind, id)) = &self.aggregate {
            event = event.aggregate(kind.clone(), id.clone());
        }
        if let Some(c) = &self.correlation_id {
            event = event.correlation_id(c.clone());
        }
        if let Some(c) = &self.causation_id {
            event = event.causation_id(c.clone());
        }
        if let Some(s) = &self.source {
            event = event.source(s.clone());
        }
        if let Some(d) = self.delay {
            event = event.delay(d);
        }
        for (key, value) in &self.headers {
            event = event.header(key.clone(), value.clone());
        }
        event
    }

    /// The events to publish, read and checked before connecting.
    fn events(&self) -> Result<Vec<Event>, Failure> {
        let from_stdin = self.payload.as_deref() == Some("-");
        if self.lines && !from_stdin {
            return Err(usage(
                "error: --lines reads standard input: pass - as the payload",
            ));
        }
        let text = match self.payload.as_deref() {
            None => return Ok(vec![self.event(json!({}))]),
            Some("-") => {
                let mut text = String::new();
                std::io::stdin()
                    .read_to_string(&mut text)
                    .map_err(|e| usage(format!("error: reading standard input: {e}")))?;
                text
            }
            Some(text) => text.to_string(),
        };
        if !self.lines {
            return Ok(vec![self.event(parse_json(&text, "payload")?)]);
        }
        let mut events = Vec::new();
        for (i, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let payload = parse_json(line, &format!("payload on line {}", i + 1))?;
            events.push(self.event(payload));
        }
        if events.is_empty() {
            return Err(usage("error: no events on standard input"));
        }
        Ok(events)
    }
}

pub(crate) async fn run(args: PublishArgs, url: Option<&str>) -> Result<(), Failure> {
    let config = super::database_config(url)?;
    let events = args.events()?;
    let client = super::connect(&config).await?;
    if let [event] = &events[..]
        && !args.lines
    {
        let outcome = pgbus::publish(&client, event).await?;
        let inserted = outcome == Published::Inserted;
        let printed = if args.json {
            print_json(&json!({"id": event.id, "inserted": inserted}))
        } else {
            outln!("{}", event.id)
        };
        if !inserted {
            eprintln!(
                "pgbus: event {} was already published: nothing written",
                event.id
            );
        }
        return printed.map_err(|f| committed(f, &[event.id.as_str()], u64::from(inserted), 0));
    }
    // One statement: every line is published, or none.
    let inserted = pgbus::publish_batch(&client, &events).await?;
    let ids: Vec<&str> = events.iter().map(|e| e.id.as_str()).collect();
    if args.json {
        return print_json(&json!({"ids": ids, "inserted": inserted}))
            .map_err(|f| committed(f, &ids, inserted, 0));
    }
    for (printed, id) in ids.iter().enumerate() {
        outln!("{id}").map_err(|f| committed(f, &ids, inserted, printed))?;
    }
    Ok(())
}

/// The failure to print after the events were committed: says on standard error what
/// was published (so that nobody publishes it again), keeping the exit code of the
/// output failure (0 for a reader that went away, 1 otherwise).
fn committed(failure: Failure, ids: &[&str], inserted: u64, printed: usize) -> Failure {
    let unprinted = ids.len() - printed;
    let mut message = format!(
        "pgbus: published and committed {} event{} ({inserted} new); standard output {} \
         before {unprinted} of their ids were printed: do not publish them again",
        ids.len(),
        if ids.len() == 1 { "" } else { "s" },
        if failure.code == 0 {
            "was closed".to_string()
        } else {
            format!("failed ({})", failure.message.trim_start_matches("error: "))
        },
    );
    if let (Some(first), Some(last)) = (ids.get(printed), ids.last()) {
        message.push_str(&format!("\npgbus: the ids not printed: {first} to {last}"));
    }
    Failure {
        message,
        code: failure.code,
    }
}
