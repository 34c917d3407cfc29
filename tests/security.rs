//! Security basics: input full of SQL's special characters is data, never SQL (every
//! statement is parameterized), and publishers and consumers work with only the
//! privileges `pgbus.grant_publisher` and `pgbus.grant_consumer` give them.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use futures::StreamExt;
use pgbus::{Bus, Error, Event, HandlerError};
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::Type;
use tokio_postgres::{Client, Config, NoTls};

const WAIT: Duration = Duration::from_secs(30);

/// Text that would end a string literal, a statement, a dollar-quoted body or an
/// identifier if it were ever pasted into SQL.
const HOSTILE: &[&str] = &[
    "o'neil",
    "'';--",
    "');DROP_TABLE_pgbus.events;--",
    "$$;DROP_SCHEMA_pgbus_CASCADE;$$",
    "$tag$x$tag$",
    "\\'\\\\",
    "\"quoted\".\"ident\"",
    "E'\\x00'",
    "%s%I%L",
    "$1::text",
];

async fn count(client: &Client, sql: &str) -> i64 {
    client.query_one(sql, &[]).await.unwrap().get(0)
}

#[tokio::test]
async fn quotes_semicolons_and_dollar_quotes_are_data() {
    let db = common::test_db().await;
    let client = db.connect().await;

    // Subscription names and patterns of the same stuff.
    let (tx, mut handled) = mpsc::unbounded_channel();
    let mut bus = Bus::builder(db.config())
        .poll_interval(Duration::from_millis(200))
        .handler_fn("o'neil;$$\\", ["o'neil.*"], move |event: Event| {
            let _ = tx.send(event);
            async { Ok::<(), HandlerError>(()) }
        })
        .build()
        .unwrap();
    let mut stream = bus.subscribe("'';--$$", ["*"]).unwrap();
    let running = bus.start().await.unwrap();

    let mut sent = Vec::new();
    for (i, hostile) in HOSTILE.iter().enumerate() {
        let payload = json!({
            *hostile: hostile,
            "nested": [hostile, {"k": format!("{hostile} {hostile}")}],
        });
        sent.push(
            Event::new(format!("o'neil.{hostile}"), payload)
                .id(format!("{hostile}#{i}"))
                .aggregate(*hostile, *hostile)
                .correlation_id(*hostile)
                .causation_id(*hostile)
                .source(*hostile)
                .header(*hostile, *hostile),
        );
    }
    let (singles, batch) = sent.split_at(HOSTILE.len() / 2);
    for event in singles {
        pgbus::publish(&client, event).await.unwrap();
    }
    pgbus::publish_batch(&client, batch).await.unwrap();
    // The SQL function, called with parameters.
    let by_sql: String = client
        .query_one(
            "SELECT pgbus.publish($1, $2::jsonb, $3::jsonb, id => $4, aggregate_type => $5)",
            &[
                &"o'neil.$$;--",
                &json!({"x": "$$'\\"}),
                &json!({"h": "';"}),
                &"$$;--#sql",
                &"'",
            ],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(by_sql, "$$;--#sql");

    // Both subscriptions get everything, exactly as it was sent.
    let mut streamed = HashMap::new();
    while streamed.len() < sent.len() + 1 {
        let delivery = common::within("a delivery", WAIT, stream.next())
            .await
            .unwrap();
        streamed.insert(delivery.event().id.clone(), delivery.event().clone());
        delivery.ack().await.unwrap();
    }
    let mut by_handler = HashMap::new();
    while by_handler.len() < sent.len() + 1 {
        let event = common::within("a handled event", WAIT, handled.recv())
            .await
            .unwrap();
        by_handler.insert(event.id.clone(), event);
    }
    for event in &sent {
        for got in [&streamed[&event.id], &by_handler[&event.id]] {
            assert_eq!(got.name, event.name);
            assert_eq!(got.payload, event.payload);
            assert_eq!(got.headers, event.headers);
            assert_eq!(got.aggregate_type, event.aggregate_type);
            assert_eq!(got.aggregate_id, event.aggregate_id);
            assert_eq!(got.correlation_id, event.correlation_id);
            assert_eq!(got.causation_id, event.causation_id);
            assert_eq!(got.source, event.source);
        }
    }
    assert_eq!(streamed["$$;--#sql"].payload, json!({"x": "$$'\\"}));
    running.shutdown().await.unwrap();

    // Nothing else happened: the tables are all there, holding what was sent.
    assert_eq!(
        count(&client, "SELECT count(*) FROM pgbus.events").await,
        sent.len() as i64 + 1
    );
    assert_eq!(
        count(&client, "SELECT count(*) FROM pgbus.subscriptions").await,
        2
    );
    assert_eq!(
        count(&client, "SELECT count(*) FROM pgbus.deliveries").await,
        0
    );
}

/// Roles of this test's own (roles are cluster-wide), dropped at the end, with their
/// privileges, even when the test fails.
struct Roles {
    names: Vec<String>,
    admin: Config,
}

impl Roles {
    async fn create(admin: Config, kinds: &[&str]) -> Roles {
        let suffix = format!("{:016x}", fastrand::u64(..));
        let names: Vec<String> = kinds
            .iter()
            .map(|k| format!("pgbus_{k}_{suffix}"))
            .collect();
        let client = connect(&admin).await.unwrap();
        for name in &names {
            client
                .batch_execute(&format!("CREATE ROLE {name} LOGIN"))
                .await
                .unwrap();
        }
        Roles { names, admin }
    }
}

impl Drop for Roles {
    fn drop(&mut self) {
        let (names, admin) = (self.names.clone(), self.admin.clone());
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                let Ok(client) = connect(&admin).await else {
                    return;
                };
                for name in names {
                    let _ = client
                        .batch_execute(&format!(
                            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                             WHERE usename = '{name}';
                             DROP OWNED BY {name}; DROP ROLE {name}"
                        ))
                        .await;
                }
            });
        })
        .join();
    }
}

async fn connect(config: &Config) -> Result<Client, tokio_postgres::Error> {
    let (client, connection) = config.connect(NoTls).await?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(client)
}

fn as_role(config: &Config, role: &str) -> Config {
    let mut config = config.clone();
    config.user(role);
    config
}

/// The SQLSTATE of a failed statement.
fn code(result: Result<u64, tokio_postgres::Error>) -> SqlState {
    result
        .expect_err("the statement should have been refused")
        .code()
        .cloned()
        .expect("a database error")
}

#[tokio::test]
async fn publisher_and_consumer_roles_need_only_their_grants() {
    let db = common::test_db().await;
    let admin = db.connect().await;
    let roles = Roles::create(db.config(), &["publisher", "consumer", "nobody"]).await;
    let (publisher, consumer, nobody) = (&roles.names[0], &roles.names[1], &roles.names[2]);
    admin
        .execute(
            "SELECT pgbus.grant_publisher($1::text::regrole)",
            &[publisher],
        )
        .await
        .unwrap();
    admin
        .execute(
            "SELECT pgbus.grant_consumer($1::text::regrole)",
            &[consumer],
        )
        .await
        .unwrap();

    // A bus running as the consumer: registers its subscriptions and itself, claims,
    // fails, retries and acknowledges.
    let (tx, mut handled) = mpsc::unbounded_channel();
    let failed_once = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut bus = Bus::builder(as_role(&db.config(), consumer))
        .poll_interval(Duration::from_millis(200))
        .retry(pgbus::RetryPolicy::fixed(Duration::from_millis(10)))
        .handler_fn("audit", ["order.*"], move |event: Event| {
            let tx = tx.clone();
            let failed_once = failed_once.clone();
            async move {
                let _ = tx.send(event.id.clone());
                if event.payload["fail_first"] == true
                    && !failed_once.swap(true, std::sync::atomic::Ordering::SeqCst)
                {
                    return Err(HandlerError::new("fails once"));
                }
                Ok(())
            }
        })
        .build()
        .unwrap();
    let mut stream = bus.subscribe("view", ["*"]).unwrap();
    let running = bus.start().await.unwrap();

    // The publisher publishes every way there is.
    let pc = connect(&as_role(&db.config(), publisher)).await.unwrap();
    let placed = Event::new("order.placed", json!({"n": 1})).id("one");
    pgbus::publish(&pc, &placed).await.unwrap();
    // Idempotent, and a conflict is still a conflict.
    assert_eq!(
        pgbus::publish(&pc, &placed).await.unwrap(),
        pgbus::Published::Duplicate
    );
    let conflict = pgbus::publish(&pc, &Event::new("order.placed", json!({"n": 2})).id("one"))
        .await
        .unwrap_err();
    assert!(conflict.is_conflict(), "{conflict:?}");
    pgbus::publish_batch(
        &pc,
        &[
            Event::new("order.paid", json!({"fail_first": true})).id("two"),
            Event::new("user.seen", json!({})).id("three"),
        ],
    )
    .await
    .unwrap();
    pc.execute(
        "SELECT pgbus.publish('order.shipped', '{}', id => 'four')",
        &[],
    )
    .await
    .unwrap();
    pc.execute(
        "INSERT INTO pgbus.events (id, event_name, payload) VALUES ('five', 'order.done', '{}')",
        &[],
    )
    .await
    .unwrap();

    // Everything is delivered, through the consumer's handler (one failure) and stream.
    let mut seen = Vec::new();
    while seen.len() < 5 {
        let delivery = common::within("a delivery", WAIT, stream.next())
            .await
            .unwrap();
        seen.push(delivery.event().id.clone());
        delivery.ack().await.unwrap();
    }
    seen.sort();
    assert_eq!(seen, ["five", "four", "one", "three", "two"]);
    let mut runs = Vec::new();
    while runs.len() < 5 {
        runs.push(
            common::within("a handler run", WAIT, handled.recv())
                .await
                .unwrap(),
        );
    }
    common::wait_for("every delivery to be settled", WAIT, || async {
        count(&admin, "SELECT count(*) FROM pgbus.deliveries").await == 0
    })
    .await;
    assert_eq!(
        count(&admin, "SELECT count(*) FROM pgbus.delivery_failures").await,
        1
    );
    let stats = running.stats();
    assert_eq!((stats.claim_errors, stats.settle_errors), (0, 0));
    assert_eq!(stats.delivered, 9);

    // The maintenance statements the bus runs on its timers, run as the consumer now.
    let cc = connect(&as_role(&db.config(), consumer)).await.unwrap();
    let reap = cc
        .prepare_typed(pgbus::sql::REAP, &[Type::INT4])
        .await
        .unwrap();
    cc.query_one(&reap, &[&1000_i32]).await.unwrap();
    let extend = cc
        .prepare_typed(
            pgbus::sql::EXTEND,
            &[
                Type::TEXT_ARRAY,
                Type::INT8_ARRAY,
                Type::INT4_ARRAY,
                Type::INT8,
                Type::TEXT,
            ],
        )
        .await
        .unwrap();
    let (subs, seqs, attempts): (Vec<&str>, Vec<i64>, Vec<i32>) = (vec![], vec![], vec![]);
    cc.execute(&extend, &[&subs, &seqs, &attempts, &1000_i64, &"w"])
        .await
        .unwrap();
    running.shutdown().await.unwrap();

    // What a publisher cannot do.
    let denied = SqlState::INSUFFICIENT_PRIVILEGE;
    for sql in [
        "DELETE FROM pgbus.deliveries",
        "UPDATE pgbus.deliveries SET status = 'dead'",
        "SELECT count(*) FROM pgbus.deliveries",
        "INSERT INTO pgbus.deliveries (subscription, event_seq) VALUES ('view', 1)",
        "DELETE FROM pgbus.delivery_failures",
        "UPDATE pgbus.subscriptions SET patterns = '{x}'",
        "INSERT INTO pgbus.subscriptions (name) VALUES ('sneaky')",
        "DELETE FROM pgbus.consumers",
        "DELETE FROM pgbus.events",
        "UPDATE pgbus.events SET payload = '{}'",
        // UPDATE (id) is granted for ON CONFLICT; the log refuses any change all the same.
        "UPDATE pgbus.events SET id = 'renamed' WHERE id = 'one'",
        "TRUNCATE pgbus.events",
        "SELECT pgbus.grant_consumer(current_user::regrole)",
    ] {
        assert_eq!(code(pc.execute(sql, &[]).await), denied, "{sql}");
    }
    // And a consumer cannot publish.
    let err = pgbus::publish(&cc, &Event::new("order.placed", json!({})))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(&denied), "{err:?}");
    // A role with no grant cannot even see the schema.
    let nc = connect(&as_role(&db.config(), nobody)).await.unwrap();
    let err = pgbus::publish(&nc, &Event::new("order.placed", json!({})))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, Error::Database(_) | Error::SchemaMissing(_)) && err.code() == Some(&denied),
        "{err:?}"
    );
    let payloads: Vec<Value> = admin
        .query("SELECT payload FROM pgbus.events WHERE id = 'one'", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(payloads, [json!({"n": 1})]);
    // The retention sweep a bus runs, as the consumer: every event is done with.
    let swept = pgbus::admin::sweep_batch(&cc, Duration::from_millis(1), 100)
        .await
        .unwrap();
    assert_eq!((swept.events, swept.failures), (5, 1));
    drop((pc, cc, nc));
    drop(roles);
}
