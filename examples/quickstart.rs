//! The README's quick start: migrate, run a bus with a handler and an in-process
//! subscription, publish inside a transaction, and shut down.
//!
//! ```sh
//! DATABASE_URL=postgres://postgres@localhost/postgres cargo run --example quickstart
//! ```

use std::time::Duration;

use futures::StreamExt;
use pgbus::{Bus, Event, HandlerError, RetryPolicy};
use serde_json::json;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DATABASE_URL")?;
    let config: tokio_postgres::Config = url.parse()?;
    let (mut client, connection) = config.connect(tokio_postgres::NoTls).await?;
    tokio::spawn(connection);

    // Once per database, e.g. at deploy (also: `pgbus migrate`).
    pgbus::migrate(&client).await?;

    let mut bus = Bus::builder(config)
        .handler_fn("send-receipt", ["order.placed"], |event| async move {
            let order = event.payload["order_id"].as_i64();
            println!("receipt for order {order:?}");
            Ok::<(), HandlerError>(())
        })
        .retry(RetryPolicy::exponential(Duration::from_secs(1)).max_attempts(20))
        .concurrency(32)
        .build()?;
    let mut orders = bus.subscribe("orders-view", ["order.*"])?;
    let running = bus.start().await?;

    // Publish inside the business transaction: delivered only if it commits.
    let tx = client.transaction().await?;
    // ... the business writes ...
    pgbus::publish(
        &tx,
        &Event::new("order.placed", json!({"order_id": 42})).aggregate("order", "42"),
    )
    .await?;
    tx.commit().await?;

    if let Some(delivery) = orders.next().await {
        println!("{} {}", delivery.event().name, delivery.event().payload);
        delivery.ack().await?;
    }
    running.shutdown().await?;
    Ok(())
}
