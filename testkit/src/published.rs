//! Assertions on what the code under test published: the events in the database's log
//! (`pgbus.events`), by name and payload.
//!
//! Each takes a tokio-postgres `Client` or `Transaction` (anything
//! [`GenericClient`]): a test's own database ([`TestDb::connect`](crate::TestDb::connect))
//! holds exactly what the test published. Inside a tokio-postgres transaction, pass the
//! transaction: it sees its own events before COMMIT. A service on sqlx asserts after its
//! transaction ends, on a connection of the kit's (`db.connect()`, or
//! [`connect`](crate::connect) with `url.parse()?` for any other URL).
//!
//! ```no_run
//! use pgbus::Event;
//! use serde_json::json;
//!
//! # async fn example() {
//! let db = pgbus_testkit::test_db().await;
//! let mut client = db.connect().await;
//!
//! // The code under test: publishes in a transaction that commits...
//! let tx = client.transaction().await.unwrap();
//! pgbus::publish(&tx, &Event::new("order.placed", json!({"order_id": 42}))).await.unwrap();
//! tx.commit().await.unwrap();
//! pgbus_testkit::assert_published(&client, "order.placed", &json!({"order_id": 42})).await;
//!
//! // ... and in one that rolls back.
//! let tx = client.transaction().await.unwrap();
//! pgbus::publish(&tx, &Event::new("order.cancelled", json!({"order_id": 42}))).await.unwrap();
//! tx.rollback().await.unwrap();
//! pgbus_testkit::assert_not_published(&client, "order.cancelled").await;
//! # }
//! ```
//!
//! Payloads are compared as PostgreSQL compares `jsonb` values: key order and
//! whitespace do not matter, and `1.0` equals `1`.

use std::fmt::Write as _;

use serde_json::Value;
use tokio_postgres::GenericClient;

/// An event in the log, as the assertions read it back.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct PublishedEvent {
    /// Its position in the log: events are listed in this order.
    pub seq: i64,
    /// Its id.
    pub id: String,
    /// Its name, e.g. `order.placed`.
    pub name: String,
    /// Its payload.
    pub payload: Value,
    /// Its headers (a JSON object).
    pub headers: Value,
}

/// Every event of the log, in order; `$1`, when not null, keeps the events of that
/// name only.
const EVENTS: &str = "SELECT seq, id, event_name, payload, headers FROM pgbus.events \
     WHERE $1::text IS NULL OR event_name = $1 ORDER BY seq";

/// Whether two payloads are the same `jsonb` value.
const SAME_PAYLOAD: &str = "SELECT $1::jsonb = $2::jsonb";

async fn events<C: GenericClient + Sync>(client: &C, name: Option<&str>) -> Vec<PublishedEvent> {
    let rows = client
        .query(EVENTS, &[&name])
        .await
        .unwrap_or_else(|e| panic!("reading pgbus.events: {}", crate::error_chain(&e)));
    rows.iter()
        .map(|row| PublishedEvent {
            seq: row.get("seq"),
            id: row.get("id"),
            name: row.get("event_name"),
            payload: row.get("payload"),
            headers: row.get("headers"),
        })
        .collect()
}

async fn same_payload<C: GenericClient + Sync>(client: &C, a: &Value, b: &Value) -> bool {
    client
        .query_one(SAME_PAYLOAD, &[a, b])
        .await
        .unwrap_or_else(|e| panic!("comparing payloads: {}", crate::error_chain(&e)))
        .get(0)
}

/// The log, one event a line, for a failed assertion's message.
fn listing(events: &[PublishedEvent]) -> String {
    if events.is_empty() {
        return "the log is empty".to_owned();
    }
    let mut text = format!("the log holds {} event(s):", events.len());
    for event in events {
        let _ = write!(
            text,
            "\n  #{} {} {} (id {})",
            event.seq, event.name, event.payload, event.id
        );
    }
    text
}

/// Every event in the log, in the order they were published (`seq`).
///
/// # Panics
///
/// When the log cannot be read (a database never migrated, a lost connection).
pub async fn published<C: GenericClient + Sync>(client: &C) -> Vec<PublishedEvent> {
    events(client, None).await
}

/// Asserts that the log holds exactly one event named `name` with `payload`, and
/// returns it (to check its id, headers or position).
///
/// # Panics
///
/// When there is no such event, or more than one, with the log's events in the message;
/// as [`published`].
pub async fn assert_published<C: GenericClient + Sync>(
    client: &C,
    name: &str,
    payload: &Value,
) -> PublishedEvent {
    let named = events(client, Some(name)).await;
    let mut matching = Vec::new();
    for event in &named {
        if same_payload(client, &event.payload, payload).await {
            matching.push(event.clone());
        }
    }
    match matching.len() {
        1 => matching.remove(0),
        found => panic!(
            "expected one event {name} with payload {payload} to be published, found {found}; \
             {}",
            listing(&published(client).await)
        ),
    }
}

/// Asserts that the log holds these events, named and with these payloads, in this
/// order, and nothing else; returns them.
///
/// # Panics
///
/// When it holds anything else, with the log's events in the message; as [`published`].
pub async fn assert_published_exactly<C: GenericClient + Sync>(
    client: &C,
    expected: &[(&str, Value)],
) -> Vec<PublishedEvent> {
    let log = published(client).await;
    let mut same = log.len() == expected.len();
    for (event, (name, payload)) in log.iter().zip(expected) {
        same = same && event.name == *name && same_payload(client, &event.payload, payload).await;
    }
    if !same {
        let mut wanted = format!("expected {} event(s):", expected.len());
        for (name, payload) in expected {
            let _ = write!(wanted, "\n  {name} {payload}");
        }
        panic!("{wanted}\n{}", listing(&log));
    }
    log
}

/// Asserts that the log holds no event named `name`: whatever published one rolled back,
/// or never ran.
///
/// # Panics
///
/// When it holds one, with the log's events in the message; as [`published`].
pub async fn assert_not_published<C: GenericClient + Sync>(client: &C, name: &str) {
    if !events(client, Some(name)).await.is_empty() {
        panic!(
            "expected no event {name} to be published; {}",
            listing(&published(client).await)
        );
    }
}

/// Asserts that the log is empty: nothing was published, or everything that was rolled
/// back.
///
/// # Panics
///
/// When it holds an event, with the log's events in the message; as [`published`].
pub async fn assert_nothing_published<C: GenericClient + Sync>(client: &C) {
    let log = published(client).await;
    if !log.is_empty() {
        panic!("expected nothing to be published; {}", listing(&log));
    }
}
