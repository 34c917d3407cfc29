//! Security basics: input full of SQL's special characters is data, never SQL (every
//! statement is parameterized), and publishers and consumers work with only the
//! privileges `pgbus.grant_publisher` and `pgbus.grant_consumer` give them.

mod common;
#[path = "shared/roles.rs"]
mod roles;

use roles::Roles;

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
        .prepare_typed(pgbus_testkit::sql::REAP, &[Type::INT4])
        .await
        .unwrap();
    cc.query_one(&reap, &[&1000_i32]).await.unwrap();
    let extend = cc
        .prepare_typed(
            pgbus_testkit::sql::EXTEND,
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
    // The retention sweep a bus runs, as the consumer: every event is done with. The
    // owner lowers the shortest retention the sweep honours (1 hour by default).
    admin
        .batch_execute("UPDATE pgbus.settings SET min_retention = '0'")
        .await
        .unwrap();
    let swept = pgbus::admin::sweep_batch(&cc, Duration::from_millis(1), 100)
        .await
        .unwrap();
    assert_eq!((swept.events, swept.failures), (5, 1));
    drop((pc, cc, nc));
    drop(roles);
}

/// Roles granted as a publisher and as a consumer, with their clients and the admin's.
struct Hostile {
    roles: Roles,
    admin: Client,
    publisher: Client,
    consumer: Client,
}

impl Hostile {
    async fn new(db: &common::TestDb) -> Hostile {
        let admin = db.connect().await;
        let roles = Roles::create(db.config(), &["publisher", "consumer"]).await;
        for (role, grant) in [
            (&roles.names[0], "publisher"),
            (&roles.names[1], "consumer"),
        ] {
            admin
                .execute(
                    &format!("SELECT pgbus.grant_{grant}($1::text::regrole)"),
                    &[role],
                )
                .await
                .unwrap();
        }
        let publisher = connect(&as_role(&db.config(), &roles.names[0]))
            .await
            .unwrap();
        let consumer = connect(&as_role(&db.config(), &roles.names[1]))
            .await
            .unwrap();
        Hostile {
            roles,
            admin,
            publisher,
            consumer,
        }
    }

    fn publisher_name(&self) -> &str {
        &self.roles.names[0]
    }

    fn consumer_name(&self) -> &str {
        &self.roles.names[1]
    }

    /// Whether a role became a superuser.
    async fn is_superuser(&self, role: &str) -> bool {
        self.admin
            .query_one("SELECT rolsuper FROM pg_roles WHERE rolname = $1", &[&role])
            .await
            .unwrap()
            .get(0)
    }

    /// A snapshot of every table's content, to show that refused attempts change nothing.
    async fn tables(&self) -> Vec<String> {
        let mut out = Vec::new();
        for table in [
            "events",
            "deliveries",
            "subscriptions",
            "delivery_failures",
            "settings",
        ] {
            let rows = self
                .admin
                .query(
                    &format!("SELECT t::text FROM pgbus.{table} AS t ORDER BY 1"),
                    &[],
                )
                .await
                .unwrap();
            out.extend(
                rows.iter()
                    .map(|r| format!("{table}: {}", r.get::<_, String>(0))),
            );
        }
        out
    }
}

/// Every owner-rights function pins its search_path with pg_temp last, so that no
/// caller's temporary objects are ever found first; a future migration cannot add one
/// that does not.
#[tokio::test]
async fn every_owner_rights_function_pins_pg_temp_last() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let rows = client
        .query(
            "SELECT p.oid::regprocedure::text, coalesce(p.proconfig, '{}')
             FROM pg_proc AS p JOIN pg_namespace AS n ON n.oid = p.pronamespace
             WHERE n.nspname = 'pgbus' AND p.prosecdef
             ORDER BY 1",
            &[],
        )
        .await
        .unwrap();
    let names: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
    for expected in ["pgbus.fan_out()", "pgbus.notify_at_commit()"] {
        assert!(names.iter().any(|n| n == expected), "{names:?}");
    }
    assert!(
        names.iter().any(|n| n.starts_with("pgbus.sweep(")),
        "{names:?}"
    );
    for row in &rows {
        let name: String = row.get(0);
        let config: Vec<String> = row.get(1);
        let path = config
            .iter()
            .find_map(|c| c.strip_prefix("search_path="))
            .unwrap_or_else(|| panic!("{name} has no search_path: {config:?}"));
        let parts: Vec<&str> = path
            .split(',')
            .map(|p| p.trim().trim_matches('"'))
            .collect();
        assert_eq!(
            parts,
            ["pg_catalog", "pgbus", "pg_temp"],
            "{name} runs with search_path {path}"
        );
    }
}

/// The escalation: a publisher shadows the types an owner-rights function uses with
/// temporary domains whose CHECK runs its own code, then publishes. With pg_temp last in
/// the pinned search_path its code never runs; with the path of earlier versions it
/// made the publisher a superuser, which shows that the test can fail.
#[tokio::test]
async fn a_publisher_cannot_run_code_with_the_owners_rights_through_pg_temp() {
    let db = common::test_db().await;
    let h = Hostile::new(&db).await;
    h.admin
        .batch_execute(
            "INSERT INTO pgbus.subscriptions (name, patterns, ordered) VALUES ('o', '{*}', true);
             INSERT INTO pgbus.subscriptions (name, patterns) VALUES ('u', '{*}');",
        )
        .await
        .unwrap();
    let me = h.publisher_name().to_string();
    let shadow = format!(
        "CREATE FUNCTION pg_temp.escalate() RETURNS boolean LANGUAGE plpgsql AS $f$
         BEGIN
             IF current_user <> '{me}' THEN
                 EXECUTE 'ALTER ROLE {me} SUPERUSER';
             END IF;
             RETURN true;
         END $f$;
         CREATE DOMAIN pg_temp.text AS pg_catalog.text CHECK (pg_temp.escalate());
         CREATE DOMAIN pg_temp.int8 AS pg_catalog.int8 CHECK (pg_temp.escalate());
         CREATE DOMAIN pg_temp.bigint AS pg_catalog.int8 CHECK (pg_temp.escalate());
         CREATE DOMAIN pg_temp.bool AS pg_catalog.bool CHECK (pg_temp.escalate());
         CREATE DOMAIN pg_temp.boolean AS pg_catalog.bool CHECK (pg_temp.escalate());
         CREATE DOMAIN pg_temp.timestamptz AS pg_catalog.timestamptz CHECK (pg_temp.escalate());
         CREATE DOMAIN pg_temp.jsonb AS pg_catalog.jsonb CHECK (pg_temp.escalate());
         CREATE TEMP TABLE subscriptions (name text, patterns text[], ordered bool);
         CREATE TEMP TABLE deliveries (subscription text);
         CREATE TEMP TABLE consumers (id text, awake bool, expires_at timestamptz);"
    );
    let publish = "SELECT pgbus.publish('order.placed', '{}', ordering_key => 'k1');
                   INSERT INTO pgbus.events (event_name, ordering_key) VALUES ('order.paid', 'k1')";

    // With today's functions: nothing runs as the owner, and the events are delivered
    // to both subscriptions as usual.
    h.publisher.batch_execute(&shadow).await.unwrap();
    h.publisher.batch_execute(publish).await.unwrap();
    assert!(
        !h.is_superuser(&me).await,
        "the publisher became a superuser"
    );
    let deliveries = count(&h.admin, "SELECT count(*) FROM pgbus.deliveries").await;
    assert_eq!(deliveries, 4);

    // The same with the search_path of earlier versions (pg_temp implicitly first).
    h.admin
        .batch_execute(
            "ALTER FUNCTION pgbus.fan_out() SET search_path = pg_catalog, pgbus;
             ALTER FUNCTION pgbus.notify_at_commit() SET search_path = pg_catalog, pgbus;",
        )
        .await
        .unwrap();
    let _ = h.publisher.batch_execute(publish).await;
    assert!(
        h.is_superuser(&me).await,
        "the negative control did not escalate: the test cannot tell"
    );
}

/// The consumer's owner-rights function, the retention sweep, shadowed the same way.
#[tokio::test]
async fn a_consumer_cannot_run_code_with_the_owners_rights_through_the_sweep() {
    let db = common::test_db().await;
    let h = Hostile::new(&db).await;
    let me = h.consumer_name().to_string();
    h.admin
        .batch_execute(
            "INSERT INTO pgbus.events (event_name, created_at) VALUES ('a.b', now() - interval '30 days')",
        )
        .await
        .unwrap();
    h.consumer
        .batch_execute(&format!(
            "CREATE FUNCTION pg_temp.escalate() RETURNS boolean LANGUAGE plpgsql AS $f$
             BEGIN
                 IF current_user <> '{me}' THEN
                     EXECUTE 'ALTER ROLE {me} SUPERUSER';
                 END IF;
                 RETURN true;
             END $f$;
             CREATE DOMAIN pg_temp.timestamptz AS pg_catalog.timestamptz CHECK (pg_temp.escalate());
             CREATE DOMAIN pg_temp.int8 AS pg_catalog.int8 CHECK (pg_temp.escalate());
             CREATE DOMAIN pg_temp.bool AS pg_catalog.bool CHECK (pg_temp.escalate());
             CREATE TEMP TABLE events (seq bigint, created_at timestamptz);
             CREATE TEMP TABLE settings (min_retention interval);"
        ))
        .await
        .unwrap();
    let swept = pgbus::admin::sweep(&h.consumer, Duration::from_secs(60), 10)
        .await
        .unwrap();
    assert_eq!(swept.events, 1);
    assert!(
        !h.is_superuser(&me).await,
        "the consumer became a superuser"
    );
}

/// Grants are as narrow as they read: a publisher writes only the publishable columns,
/// a consumer never deletes from the log nor inserts deliveries, and neither reaches
/// the operators' functions. Every refused attempt leaves every table as it was.
#[tokio::test]
async fn grants_are_column_level_and_refusals_change_nothing() {
    let db = common::test_db().await;
    let h = Hostile::new(&db).await;
    h.admin
        .batch_execute(
            "INSERT INTO pgbus.subscriptions (name, patterns) VALUES ('s', '{*}');
             SELECT pgbus.publish('a.b', '{\"n\": 1}', id => 'kept');",
        )
        .await
        .unwrap();
    let before = h.tables().await;
    let denied = SqlState::INSUFFICIENT_PRIVILEGE;
    for sql in [
        // A chosen seq would block every later publish on the primary key.
        "INSERT INTO pgbus.events (seq, event_name) OVERRIDING SYSTEM VALUE VALUES (1000000, 'a.b')",
        "INSERT INTO pgbus.events (event_name, created_at) VALUES ('a.b', now() - interval '1 year')",
        "UPDATE pgbus.settings SET min_retention = '0'",
        "SELECT pgbus.sweep(0, 100, 1)",
        "SELECT * FROM pgbus.configure_subscription('s', p_ordered => true)",
        "SELECT * FROM pgbus.purge_dead(NULL, NULL)",
        "DELETE FROM pgbus.deliveries",
    ] {
        assert_eq!(
            code(h.publisher.execute(sql, &[]).await),
            denied,
            "publisher: {sql}"
        );
    }
    for sql in [
        "DELETE FROM pgbus.events",
        "DELETE FROM pgbus.events WHERE id = 'kept'",
        "INSERT INTO pgbus.deliveries (subscription, event_seq) VALUES ('s', 1)",
        "INSERT INTO pgbus.events (event_name) VALUES ('a.b')",
        "UPDATE pgbus.settings SET min_retention = '0'",
        "TRUNCATE pgbus.events",
    ] {
        assert_eq!(
            code(h.consumer.execute(sql, &[]).await),
            denied,
            "consumer: {sql}"
        );
    }
    assert_eq!(h.tables().await, before);

    // The sweep deletes only what retention allows, whatever the consumer asks for: not
    // an event younger than the owner's floor (1 hour by default), never one that a
    // delivery still needs.
    h.admin
        .batch_execute(
            "UPDATE pgbus.subscriptions SET patterns = '{a.*}' WHERE name = 's';
             INSERT INTO pgbus.events (id, event_name, created_at) VALUES
               ('young-done', 'z.z', now() - interval '30 minutes'),
               ('old-done', 'z.z', now() - interval '30 days'),
               ('old-pending', 'a.b', now() - interval '30 days');",
        )
        .await
        .unwrap();
    let swept = pgbus::admin::sweep(&h.consumer, Duration::from_millis(1), 100)
        .await
        .unwrap();
    assert_eq!(swept.events, 1);
    let left: Vec<String> = h
        .admin
        .query("SELECT id FROM pgbus.events ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(left, ["kept", "old-pending", "young-done"]);
}

/// The switch that once turned the key locks off is gone: a session that sets it still
/// waits for another transaction's lock on the same key.
#[tokio::test]
async fn no_setting_turns_the_key_locks_off() {
    let db = common::test_db().await;
    let h = Hostile::new(&db).await;
    h.admin
        .batch_execute(
            "INSERT INTO pgbus.subscriptions (name, patterns, ordered) VALUES ('o', '{*}', true)",
        )
        .await
        .unwrap();
    let mut holder = connect(&as_role(&db.config(), h.publisher_name()))
        .await
        .unwrap();
    let tx = holder.transaction().await.unwrap();
    tx.batch_execute("SELECT pgbus.publish('a.b', '{}', ordering_key => 'k')")
        .await
        .unwrap();
    let err = h
        .publisher
        .batch_execute(
            "SET pgbus.key_locks = off;
             BEGIN;
             SET LOCAL lock_timeout = '300ms';
             SELECT pgbus.publish('a.b', '{}', ordering_key => 'k');",
        )
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(&SqlState::LOCK_NOT_AVAILABLE), "{err:?}");
    h.publisher.batch_execute("ROLLBACK").await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(
        count(
            &h.admin,
            "SELECT count(*) FROM pgbus.deliveries WHERE is_head"
        )
        .await,
        1
    );
}
