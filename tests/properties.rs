//! Bad input, systematically: generated event names, patterns, headers and payloads
//! (deep nesting, large strings, every JSON escape, `\u0000` at depth). Each is either
//! accepted and comes back equal (JSON value equality) from the log and from a bus
//! delivery, or refused with [`pgbus::Error::Invalid`] with nothing written. And the
//! library's rules for names and patterns agree with the schema's.
//!
//! One database and one bus serve all the cases of a property; 64 cases each.

mod common;

use std::time::Duration;

use futures::StreamExt;
use pgbus::{Bus, Error, Event, RunningBus, Subscription};
use proptest::collection::{btree_map, vec};
use proptest::prelude::*;
use proptest::test_runner::{Config as RunnerConfig, TestCaseError, TestRunner};
use serde_json::{Map, Value};
use tokio::runtime::Runtime;
use tokio_postgres::Client;

const CASES: u32 = 64;
const WAIT: Duration = Duration::from_secs(30);

fn runner() -> TestRunner {
    TestRunner::new(RunnerConfig {
        cases: CASES,
        failure_persistence: None,
        ..RunnerConfig::default()
    })
}

fn runtime() -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// Pieces that JSON text escapes, or that SQL would choke on if it were ever pasted into
/// a statement.
const NASTY: &[&str] = &[
    "\"",
    "\\",
    "/",
    "\u{8}",
    "\u{c}",
    "\n",
    "\r",
    "\t",
    "\u{1}",
    "\u{1f}",
    "\u{7f}",
    "\u{80}",
    "\u{85}",
    "\u{a0}",
    "\u{2028}",
    "\u{2029}",
    "\u{feff}",
    "\u{fffd}",
    "\u{ffff}",
    "\u{10ffff}",
    "😀",
    "é",
    "\\u0000",
    "\\ud800",
    "$$",
    "$tag$",
    "'",
    "''",
    ";",
    "--",
    "/*",
    "%",
    "_",
    "?",
    "$1",
];

fn nasty() -> impl Strategy<Value = String> {
    vec(
        prop_oneof![
            3 => proptest::sample::select(NASTY).prop_map(String::from),
            1 => "[a-zA-Z0-9]{1,4}",
        ],
        0..12,
    )
    .prop_map(|parts| parts.concat())
}

/// Strings: anything, escapes, `\u0000` somewhere, and now and then a large one.
fn json_string() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => any::<String>(),
        4 => nasty(),
        1 => (nasty(), nasty()).prop_map(|(a, b)| format!("{a}\u{0}{b}")),
        1 => (1usize..300_000).prop_map(|n| "ab\"\\é".repeat(n / 6 + 1)),
    ]
}

fn leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>().prop_map(Value::from),
        json_string().prop_map(Value::from),
    ]
}

fn json_value() -> impl Strategy<Value = Value> {
    leaf().prop_recursive(6, 48, 6, |inner| {
        prop_oneof![
            vec(inner.clone(), 0..6).prop_map(Value::Array),
            btree_map(json_string(), inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// A value nested `depth` levels deep in arrays and objects, with `leaf` at the bottom.
fn nest(depth: usize, leaf: Value) -> Value {
    (0..depth).fold(leaf, |inner, level| {
        if level % 2 == 0 {
            Value::Array(vec![inner])
        } else {
            let mut map = Map::new();
            map.insert(format!("k{level}"), inner);
            Value::Object(map)
        }
    })
}

fn payload() -> impl Strategy<Value = Value> {
    prop_oneof![
        6 => json_value(),
        // Deep nesting, with anything (`\u0000` too) at the bottom.
        2 => (1usize..120, leaf()).prop_map(|(depth, leaf)| nest(depth, leaf)),
    ]
}

fn headers() -> impl Strategy<Value = Value> {
    prop_oneof![
        4 => btree_map(json_string(), json_value(), 0..5)
            .prop_map(|m| Value::Object(m.into_iter().collect())),
        1 => json_value(),
    ]
}

/// Names: plausible ones, and every way to get one wrong (empty, white space, control
/// characters, `*`, around the 255-byte limit).
fn name() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => "[a-z][a-z0-9_.-]{0,20}",
        2 => "\\PC{1,12}",
        2 => any::<String>(),
        1 => nasty(),
        1 => Just(String::new()),
        1 => "[a-z]{1,6}[ \t\n\r\u{0}\u{85}\u{a0}\u{2028}\u{3000}*][a-z]{0,4}",
        1 => (120usize..136, "[a-z]").prop_map(|(n, c)| format!("{c}{}", "é".repeat(n))),
    ]
}

fn pattern() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => name(),
        2 => name().prop_map(|n| format!("{n}.*")),
        1 => Just("*".to_string()),
        1 => "[a-z*.]{0,6}",
    ]
}

/// JSON value equality: numbers compare by value. (jsonb stores numbers as `numeric`, so
/// a float with an integral value, such as `1e17` written as `1e17`, comes back as the
/// integer `100000000000000000`: the same number, another `serde_json` variant.)
fn same_json(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => match (x.as_i128(), y.as_i128()) {
            (Some(x), Some(y)) => x == y,
            _ => x.as_f64() == y.as_f64(),
        },
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(x, y)| same_json(x, y))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len()
                && x.iter()
                    .all(|(k, v)| y.get(k).is_some_and(|w| same_json(v, w)))
        }
        (x, y) => x == y,
    }
}

async fn count(client: &Client, sql: &str) -> i64 {
    client.query_one(sql, &[]).await.unwrap().get(0)
}

fn fail(message: impl Into<String>) -> TestCaseError {
    TestCaseError::fail(message.into())
}

/// A bus delivering every event to a stream.
async fn everything(db: &common::TestDb) -> (RunningBus, Subscription) {
    let mut bus = Bus::builder(db.config())
        .poll_interval(Duration::from_millis(200))
        .build()
        .unwrap();
    let stream = bus.subscribe("everything", ["*"]).unwrap();
    (bus.start().await.unwrap(), stream)
}

/// The delivery of event `id`, acknowledged.
async fn delivered(stream: &mut Subscription, id: &str) -> Event {
    loop {
        let delivery = common::within("a delivery", WAIT, stream.next())
            .await
            .expect("the stream ended");
        let event = delivery.event().clone();
        delivery.ack().await.unwrap();
        if event.id == id {
            return event;
        }
    }
}

#[test]
fn events_round_trip_or_are_refused_with_nothing_written() {
    let rt = runtime();
    let db = rt.block_on(common::test_db());
    let client = rt.block_on(db.connect());
    let (bus, stream) = rt.block_on(everything(&db));
    let stream = tokio::sync::Mutex::new(stream);
    let accepted = std::sync::atomic::AtomicU32::new(0);
    let strategy = (name(), payload(), headers());
    runner()
        .run(&strategy, |(name, payload, headers)| {
            rt.block_on(async {
                let before = count(&client, "SELECT count(*) FROM pgbus.events").await;
                let event = Event::new(name.clone(), payload.clone()).headers(headers.clone());
                match pgbus::publish(&client, &event).await {
                    Ok(_) => {
                        accepted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let row = client
                            .query_one(
                                "SELECT event_name, payload, headers FROM pgbus.events \
                                 WHERE id = $1",
                                &[&event.id],
                            )
                            .await
                            .unwrap();
                        prop_assert_eq!(row.get::<_, String>(0), name.clone());
                        let (p, h) = (row.get::<_, Value>(1), row.get::<_, Value>(2));
                        prop_assert!(same_json(&p, &payload), "{p} vs {payload}");
                        prop_assert!(same_json(&h, &headers), "{h} vs {headers}");
                        let back = {
                            let mut stream = stream.lock().await;
                            delivered(&mut stream, &event.id).await
                        };
                        prop_assert_eq!(&back.name, &name);
                        prop_assert!(same_json(&back.payload, &payload));
                        prop_assert!(same_json(&back.headers, &headers));
                    }
                    Err(Error::Invalid { what, reason }) => {
                        prop_assert!(!reason.is_empty(), "{} refused without a reason", what);
                        let after = count(&client, "SELECT count(*) FROM pgbus.events").await;
                        prop_assert_eq!(before, after, "a refused event wrote something");
                    }
                    Err(e) => {
                        return Err(fail(format!(
                            "neither accepted nor refused as invalid: {e:?} \
                             (name {name:?})"
                        )));
                    }
                }
                Ok(())
            })
        })
        .unwrap();
    // The strategies are not all refusals.
    assert!(accepted.into_inner() > 0, "no case was accepted");
    rt.block_on(bus.shutdown()).unwrap();
    assert_eq!(
        rt.block_on(count(&client, "SELECT count(*) FROM pgbus.deliveries")),
        0
    );
}

#[test]
fn batches_round_trip_or_are_refused_whole() {
    let rt = runtime();
    let db = rt.block_on(common::test_db());
    let client = rt.block_on(db.connect());
    let strategy = vec((name(), payload()), 1..6);
    runner()
        .run(&strategy, |events| {
            rt.block_on(async {
                let before = count(&client, "SELECT count(*) FROM pgbus.events").await;
                let batch: Vec<Event> = events
                    .iter()
                    .map(|(name, payload)| Event::new(name.clone(), payload.clone()))
                    .collect();
                match pgbus::publish_batch(&client, &batch).await {
                    Ok(n) => {
                        prop_assert_eq!(n as usize, batch.len());
                        for event in &batch {
                            let row = client
                                .query_one(
                                    "SELECT event_name, payload FROM pgbus.events WHERE id = $1",
                                    &[&event.id],
                                )
                                .await
                                .unwrap();
                            prop_assert_eq!(&row.get::<_, String>(0), &event.name);
                            let p = row.get::<_, Value>(1);
                            prop_assert!(same_json(&p, &event.payload), "{p}");
                        }
                    }
                    Err(Error::Invalid { .. }) => {
                        let after = count(&client, "SELECT count(*) FROM pgbus.events").await;
                        prop_assert_eq!(before, after, "a refused batch wrote something");
                    }
                    Err(e) => return Err(fail(format!("{e:?}"))),
                }
                Ok(())
            })
        })
        .unwrap();
}

#[test]
fn names_and_patterns_follow_the_schemas_rules() {
    let rt = runtime();
    let db = rt.block_on(common::test_db());
    let client = rt.block_on(db.connect());
    let strategy = (name(), pattern(), name());
    runner()
        .run(&strategy, |(sub, pattern, event_name)| {
            rt.block_on(async {
                let mut bus = Bus::builder(db.config()).build().unwrap();
                let in_rust = bus.subscribe(&sub, [pattern.as_str()]);
                let before = count(&client, "SELECT count(*) FROM pgbus.subscriptions").await;
                let registered =
                    pgbus::admin::register_subscription(&client, &sub, &[&pattern], 5).await;
                match (&in_rust, &registered) {
                    (Ok(_), Ok(())) => {
                        client
                            .execute("DELETE FROM pgbus.subscriptions WHERE name = $1", &[&sub])
                            .await
                            .unwrap();
                    }
                    (Err(Error::Invalid { .. }), Err(Error::Invalid { .. })) => {
                        let after =
                            count(&client, "SELECT count(*) FROM pgbus.subscriptions").await;
                        prop_assert_eq!(before, after, "a refused subscription was written");
                    }
                    (a, b) => {
                        return Err(fail(format!(
                            "subscribe gave {a:?}, registering gave {b:?} for {sub:?} {pattern:?}"
                        )));
                    }
                }
                // Text with NUL cannot even be sent as a parameter; the library refuses it.
                if sub.contains('\0') || pattern.contains('\0') {
                    prop_assert!(in_rust.is_err());
                    return Ok(());
                }
                let event_name = event_name.replace('\0', "");
                // What the library accepts, the schema's CHECK constraints accept.
                let row = client
                    .query_one(
                        "SELECT pgbus.valid_name($1), pgbus.valid_pattern($2), \
                                pgbus.pattern_matches($2, $3)",
                        &[&sub, &pattern, &event_name],
                    )
                    .await
                    .unwrap();
                if in_rust.is_ok() {
                    prop_assert!(row.get::<_, bool>(0), "the schema refuses name {:?}", sub);
                    prop_assert!(
                        row.get::<_, bool>(1),
                        "the schema refuses pattern {:?}",
                        pattern
                    );
                    // Routing in the library and fan-out in the schema agree.
                    prop_assert_eq!(
                        pgbus::pattern_matches(&pattern, &event_name),
                        row.get::<_, bool>(2),
                        "{:?} vs {:?}",
                        pattern,
                        event_name
                    );
                }
                Ok(())
            })
        })
        .unwrap();
}
