//! Every repeated warning is rate-limited, the connection pool's included: through
//! outages in which every pgbus backend is terminated (each pooled connection then
//! closed), each kind of warning is logged at most once per interval
//! ([`WARN_EVERY`](pgbus::__private::WARN_EVERY)), and the pool's own "Connection could
//! not be recycled" (several per outage, in the same millisecond) never.

mod common;
#[path = "shared/logs.rs"]
mod logs;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use pgbus::{Bus, Event};
use serde_json::json;
use tokio::sync::mpsc;

/// The kind of a warning line: its target and message, without its fields (the
/// rate-limited ones print `suppressed=N` first).
fn kind(line: &str) -> Option<String> {
    let (_, rest) = line.split_once(" WARN ")?;
    let kind = rest.split(" suppressed=").next().unwrap_or(rest);
    Some(kind.trim().to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outages_log_each_kind_of_warning_once_per_interval() {
    let logs = logs::LogBuffer::install("pgbus=debug,deadpool=warn");
    let started = Instant::now();
    let db = common::test_db().await;
    let client = db.connect().await;
    let (tx, mut handled) = mpsc::unbounded_channel();
    let running = Bus::builder(db.config())
        .poll_interval(Duration::from_millis(100))
        .pool_size(4)
        .handler_fn("h", ["*"], move |e: Event| {
            let _ = tx.send(e.id.clone());
            async { Ok(()) }
        })
        .build()
        .unwrap()
        .start()
        .await
        .unwrap();
    let outages = 4;
    for i in 0..outages {
        // A few deliveries at once, so that the pool holds several connections.
        for j in 0..8 {
            pgbus::publish(&client, &Event::new("x", json!({})).id(format!("o{i}-{j}")))
                .await
                .unwrap();
        }
        let last = format!("o{i}-7");
        loop {
            let got = common::within(
                "the outage's events",
                Duration::from_secs(30),
                handled.recv(),
            )
            .await
            .unwrap();
            if got == last {
                break;
            }
        }
        // The outage: every backend of the bus terminated, its pooled connections with
        // them. Counted before: the listener's reconnection may make the bus claim, and
        // find a closed connection, before this task reads the log again.
        let before = logs.count("pgbus dropped a pooled connection");
        client
            .execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                 WHERE datname = current_database()
                   AND application_name IN ('pgbus worker', 'pgbus listener')",
                &[],
            )
            .await
            .unwrap();
        common::wait_for(
            "the pool to find a closed connection",
            Duration::from_secs(30),
            || async {
                running.wake();
                logs.count("pgbus dropped a pooled connection") > before
            },
        )
        .await;
    }
    // The bus recovered.
    pgbus::publish(&client, &Event::new("x", json!({})).id("after"))
        .await
        .unwrap();
    loop {
        let got = common::within(
            "the event after the outages",
            Duration::from_secs(30),
            handled.recv(),
        )
        .await
        .unwrap();
        if got == "after" {
            break;
        }
    }
    running.shutdown().await.unwrap();
    let took = started.elapsed();

    let lines = logs.lines();
    let mut kinds: HashMap<String, usize> = HashMap::new();
    for k in lines.iter().filter_map(|l| kind(l)) {
        *kinds.entry(k).or_default() += 1;
    }
    println!("{outages} outages in {took:?}: {kinds:#?}");
    let dropped = lines
        .iter()
        .filter(|l| l.contains("pgbus dropped a pooled connection"))
        .count();
    assert!(
        dropped > 1,
        "the pool found closed connections ({dropped} times, warned or not)"
    );
    assert_eq!(
        logs.count("Connection could not be recycled"),
        0,
        "the pool's own warning"
    );
    // The whole run lasted less than one interval: at most one line of each kind.
    assert!(took < pgbus::__private::WARN_EVERY, "{took:?}");
    for (k, n) in &kinds {
        assert!(*n <= 1, "{n} warnings of one kind: {k}");
    }
}
