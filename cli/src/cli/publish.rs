//! `pgbus publish`: publish one event, or many from standard input in one transaction.

use std::io::Read as _;
use std::time::Duration;

use pgbus::trace_context::{TRACEPARENT, TRACESTATE, TraceParent, check_tracestate};
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

The trace context of the caller (OpenTelemetry's process carriers, the environment
variables TRACEPARENT and TRACESTATE) goes into the headers traceparent and tracestate,
unless --header gives either; a malformed traceparent or tracestate is refused.

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

    /// Adds the trace context of the environment (`TRACEPARENT`, `TRACESTATE`: the
    /// OpenTelemetry carriers of a process) to the headers, unless `--header` gives a
    /// `traceparent` or a `tracestate`; then checks the trace context's headers, from
    /// either: a malformed one is bad input (exit 2, nothing published).
    fn add_trace_context(&mut self) -> Result<(), Failure> {
        let given = |key: &str| self.headers.iter().any(|(k, _)| k == key);
        let mut from_env = Vec::new();
        if !given(TRACEPARENT)
            && !given(TRACESTATE)
            && let Some(parent) = env_var("TRACEPARENT")?
        {
            from_env.push((TRACEPARENT, parent, "the environment variable TRACEPARENT"));
            if let Some(state) = env_var("TRACESTATE")? {
                from_env.push((TRACESTATE, state, "the environment variable TRACESTATE"));
            }
        }
        let flags = self
            .headers
            .iter()
            .map(|(k, v)| (k.as_str(), v, "--header"));
        let env = from_env.iter().map(|(k, v, from)| (*k, v, *from));
        for (key, value, from) in flags.chain(env) {
            let checked = match key {
                TRACEPARENT => value.parse::<TraceParent>().map(drop),
                TRACESTATE => check_tracestate(value),
                _ => Ok(()),
            };
            checked.map_err(|e| usage(format!("error: {e}, from {from}")))?;
        }
        let env = from_env.into_iter().map(|(k, v, _)| (k.to_string(), v));
        self.headers.extend(env);
        Ok(())
    }

    /// The one event to publish (without --lines), read and checked before connecting.
    fn event_from_args(&self) -> Result<Event, Failure> {
        let text = match self.payload.as_deref() {
            None => return Ok(self.event(json!({}))),
            Some("-") => {
                let mut text = String::new();
                std::io::stdin()
                    .read_to_string(&mut text)
                    .map_err(|e| usage(format!("error: reading standard input: {e}")))?;
                text
            }
            Some(text) => text.to_string(),
        };
        Ok(self.event(parse_json(&text, "payload")?))
    }
}

/// How many `--lines` events go to PostgreSQL in one statement.
const LINES_CHUNK: usize = 1000;

/// `--lines`: reads standard input a line at a time and publishes it in chunks of
/// [`LINES_CHUNK`], all in one transaction, so memory stays bounded by a chunk whatever
/// the input's size. Bad input anywhere rolls everything back. Returns the ids, in
/// order, and how many were new.
async fn publish_lines(
    args: &PublishArgs,
    client: &mut tokio_postgres::Client,
) -> Result<(Vec<String>, u64), Failure> {
    use tokio::io::AsyncBufReadExt as _;
    let tx = client.transaction().await?;
    let mut lines = tokio::io::BufReader::new(tokio::io::stdin()).lines();
    let (mut ids, mut inserted, mut chunk, mut n) = (Vec::new(), 0, Vec::new(), 0);
    loop {
        let line = lines
            .next_line()
            .await
            .map_err(|e| usage(format!("error: reading standard input: {e}")))?;
        let done = line.is_none();
        if let Some(line) = line {
            n += 1;
            if line.trim().is_empty() {
                continue;
            }
            let payload = parse_json(&line, &format!("payload on line {n}"))?;
            chunk.push(args.event(payload));
        }
        if chunk.len() >= LINES_CHUNK || (done && !chunk.is_empty()) {
            inserted += pgbus::publish_batch(&tx, &chunk).await?;
            ids.extend(chunk.drain(..).map(|e| e.id));
        }
        if done {
            break;
        }
    }
    if ids.is_empty() {
        return Err(usage("error: no events on standard input"));
    }
    tx.commit().await?;
    Ok((ids, inserted))
}

/// An environment variable; unset and empty are the same (no value).
fn env_var(name: &str) -> Result<Option<String>, Failure> {
    match std::env::var(name) {
        Ok(value) if value.is_empty() => Ok(None),
        Ok(value) => Ok(Some(value)),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(_)) => Err(usage(format!(
            "error: the environment variable {name} is not valid UTF-8"
        ))),
    }
}

pub(crate) async fn run(mut args: PublishArgs, url: Option<&str>) -> Result<(), Failure> {
    let config = super::database_config(url)?;
    args.add_trace_context()?;
    if args.lines {
        if args.payload.as_deref() != Some("-") {
            return Err(usage(
                "error: --lines reads standard input: pass - as the payload",
            ));
        }
        let mut client = super::connect(&config).await?;
        let (ids, inserted) = publish_lines(&args, &mut client).await?;
        let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
        return print_ids(&args, &ids, inserted);
    }
    let event = args.event_from_args()?;
    let client = super::connect(&config).await?;
    let outcome = pgbus::publish(&client, &event).await?;
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
    printed.map_err(|f| committed(f, &[event.id.as_str()], u64::from(inserted), 0))
}

/// Prints the ids of committed events; a failing output says what was committed.
fn print_ids(args: &PublishArgs, ids: &[&str], inserted: u64) -> Result<(), Failure> {
    if args.json {
        return print_json(&json!({"ids": ids, "inserted": inserted}))
            .map_err(|f| committed(f, ids, inserted, 0));
    }
    for (printed, id) in ids.iter().enumerate() {
        outln!("{id}").map_err(|f| committed(f, ids, inserted, printed))?;
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
