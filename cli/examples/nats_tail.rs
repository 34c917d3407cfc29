//! A NATS JetStream consumer of what `pgbus forward` writes: prints each message of a
//! stream (from its first) as one line: stream sequence, subject, `Nats-Msg-Id`, the
//! event's key (`Pgbus-Ordering-Key`, else its aggregate) and the JSON body.
//!
//! ```text
//! cargo run -p pgbus-cli --example nats_tail -- nats://127.0.0.1:4222 PGBUS
//! ```
//!
//! It runs until stopped (Ctrl-C), or exits after `--count N` messages.

use async_nats::jetstream::{self, consumer};
use futures::StreamExt;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let mut args = std::env::args().skip(1);
    let url = args
        .next()
        .unwrap_or_else(|| "nats://127.0.0.1:4222".into());
    let stream = args.next().unwrap_or_else(|| "PGBUS".into());
    let count = match (args.next().as_deref(), args.next()) {
        (Some("--count"), Some(n)) => Some(n.parse::<usize>()?),
        _ => None,
    };
    let js = jetstream::new(async_nats::connect(url).await?);
    // An ordered consumer: ephemeral, in stream order, no acknowledgements.
    let consumer = js
        .get_stream(&stream)
        .await?
        .create_consumer(consumer::pull::OrderedConfig::default())
        .await?;
    let mut messages = consumer.messages().await?.take(count.unwrap_or(usize::MAX));
    while let Some(message) = messages.next().await {
        let message = message?;
        let header = |name: &str| {
            message
                .headers
                .as_ref()
                .and_then(|h| h.get(name))
                .map(|v| v.to_string())
        };
        let key = header("Pgbus-Ordering-Key").or_else(|| {
            Some(format!(
                "{}:{}",
                header("Pgbus-Aggregate-Type")?,
                header("Pgbus-Aggregate-Id")?
            ))
        });
        println!(
            "#{} {} id={} key={} {}",
            message.info()?.stream_sequence,
            message.subject,
            header("Nats-Msg-Id").unwrap_or_default(),
            key.unwrap_or_else(|| "-".into()),
            String::from_utf8_lossy(&message.payload)
        );
    }
    Ok(())
}
