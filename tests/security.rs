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
use tokio_postgres::types::{ToSql, Type};
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
        count(&admin, common::WORK_LEFT).await == 0
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
        // No UPDATE at all since migration 17 (the publish functions run with the owner's
        // rights); the log would refuse any change all the same.
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
    for expected in ["pgbus.fan_out_committed()", "pgbus.notify_at_commit()"] {
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
    let deliveries =
        common::count_after_fan_out(&h.admin, "SELECT count(*) FROM pgbus.deliveries").await;
    assert_eq!(deliveries, 4);

    // The same with the search_path of earlier versions (pg_temp implicitly first).
    h.admin
        .batch_execute(
            "ALTER FUNCTION pgbus.order_key() SET search_path = pg_catalog, pgbus;
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
    common::fan_out(&h.admin).await;
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
    common::fan_out(&h.admin).await;
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
        common::count_after_fan_out(
            &h.admin,
            "SELECT count(*) FROM pgbus.deliveries WHERE is_head"
        )
        .await,
        1
    );
}

// ---- The role table (docs/ARCHITECTURE.md, "Roles and privileges") ----

/// The first column of every row of `sql`.
async fn strings(client: &Client, sql: &str, params: &[&(dyn ToSql + Sync)]) -> Vec<String> {
    let rows = client.query(sql, params).await.unwrap();
    rows.iter().map(|r| r.get(0)).collect()
}

/// Everything granted to `role` in schema pgbus, one line per object and privilege:
/// `schema USAGE`, `<table> <privilege>`, `<table>(<columns>) <privilege>`,
/// `<function>() EXECUTE`.
async fn privileges(admin: &Client, role: &str) -> Vec<String> {
    strings(
        admin,
        "SELECT 'schema ' || a.privilege_type
             FROM pg_namespace AS n, aclexplode(n.nspacl) AS a
             WHERE n.nspname = 'pgbus' AND a.grantee = $1::text::regrole
             UNION ALL
             SELECT c.relname || ' ' || a.privilege_type
             FROM pg_class AS c, aclexplode(c.relacl) AS a
             WHERE c.relnamespace = 'pgbus'::regnamespace AND a.grantee = $1::text::regrole
             UNION ALL
             SELECT c.relname || '(' || string_agg(t.attname, ',' ORDER BY t.attnum) || ') '
                    || a.privilege_type
             FROM pg_attribute AS t JOIN pg_class AS c ON c.oid = t.attrelid,
                  aclexplode(t.attacl) AS a
             WHERE c.relnamespace = 'pgbus'::regnamespace AND a.grantee = $1::text::regrole
             GROUP BY c.relname, a.privilege_type
             UNION ALL
             SELECT p.proname || '() ' || a.privilege_type
             FROM pg_proc AS p, aclexplode(p.proacl) AS a
             WHERE p.pronamespace = 'pgbus'::regnamespace AND a.grantee = $1::text::regrole
             ORDER BY 1",
        &[&role],
    )
    .await
}

/// What each grant gives, as the role table in docs/ARCHITECTURE.md lists it.
const PUBLISHER: &[&str] = &[
    "events SELECT",
    "events(id,event_name,event_version,source,aggregate_type,aggregate_id,correlation_id,causation_id,occurred_at,payload,headers,available_at,ordering_key) INSERT",
    "publish() EXECUTE",
    "publish_batch() EXECUTE",
    "publish_event() EXECUTE",
    "schema USAGE",
];
const CONSUMER: &[&str] = &[
    "ack_in() EXECUTE",
    "beat() EXECUTE",
    "claim() EXECUTE",
    // With floors (migration 24), and without (a bus of the previous release).
    "claim() EXECUTE",
    "consumers SELECT",
    "deliveries SELECT",
    "delivery_failures SELECT",
    "events SELECT",
    "extend_leases() EXECUTE",
    "heartbeat() EXECUTE",
    "join_subscription() EXECUTE",
    "leader SELECT",
    "leave() EXECUTE",
    "mark_asleep() EXECUTE",
    "promote_orphans() EXECUTE",
    "reap() EXECUTE",
    "resign() EXECUTE",
    "schema USAGE",
    "settings SELECT",
    "settle() EXECUTE",
    "subscriptions SELECT",
    "sweep() EXECUTE",
];
const OPERATOR: &[&str] = &[
    "configure_subscription() EXECUTE",
    "consumers SELECT",
    "deliveries SELECT",
    "delivery_failures SELECT",
    "ensure_heads() EXECUTE",
    "events SELECT",
    "pause_subscription() EXECUTE",
    "purge_dead() EXECUTE",
    "redrive_head() EXECUTE",
    "redrive_seen_head() EXECUTE",
    "replay() EXECUTE",
    "resume_subscription() EXECUTE",
    "retry_dead() EXECUTE",
    "schema USAGE",
    "settings SELECT",
    "skip_dead_head() EXECUTE",
    "skip_seen_head() EXECUTE",
    "subscription_patterns SELECT",
    "subscriptions SELECT",
    "try_configure_subscription() EXECUTE",
];

/// Creates the roles of `kinds` and grants each its kind.
async fn granted(db: &common::TestDb, admin: &Client, kinds: &[&str]) -> Roles {
    let roles = Roles::create(db.config(), kinds).await;
    grant(
        admin,
        roles
            .names
            .iter()
            .map(String::as_str)
            .zip(kinds.iter().copied()),
    )
    .await;
    roles
}

/// Grants each role its kind (`publisher`, `consumer`, `operator`).
async fn grant<'a>(admin: &Client, roles: impl IntoIterator<Item = (&'a str, &'a str)>) {
    for (role, kind) in roles {
        admin
            .execute(
                &format!("SELECT pgbus.grant_{kind}($1::text::regrole)"),
                &[&role],
            )
            .await
            .unwrap();
    }
}

/// The grants give exactly the role table's rights; no owner-rights function a caller
/// can call is left to PUBLIC.
#[tokio::test]
async fn each_grant_gives_exactly_the_role_tables_rights() {
    let db = common::test_db().await;
    let admin = db.connect().await;
    let roles = granted(&db, &admin, &["publisher", "consumer", "operator"]).await;
    assert_eq!(privileges(&admin, &roles.names[0]).await, PUBLISHER);
    assert_eq!(privileges(&admin, &roles.names[1]).await, CONSUMER);
    assert_eq!(privileges(&admin, &roles.names[2]).await, OPERATOR);
    let public = strings(
        &admin,
        "SELECT p.oid::regprocedure::text
             FROM pg_proc AS p,
                  aclexplode(coalesce(p.proacl, acldefault('f', p.proowner))) AS a
             WHERE p.pronamespace = 'pgbus'::regnamespace AND p.prosecdef
               AND p.prorettype <> 'trigger'::regtype AND a.grantee = 0
             ORDER BY 1",
        &[],
    )
    .await;
    assert_eq!(public, Vec::<String>::new());
}

/// Every row lock a SELECT can take (each needs UPDATE on a column of the table).
const ROW_LOCKS: [&str; 4] = [
    "FOR UPDATE",
    "FOR NO KEY UPDATE",
    "FOR SHARE",
    "FOR KEY SHARE",
];

/// Runs `sql` in a transaction of its own (rolled back) and returns its SQLSTATE.
async fn refused(client: &Client, sql: &str) -> SqlState {
    let result = client.batch_execute(&format!("BEGIN; {sql}")).await;
    client.batch_execute("ROLLBACK").await.unwrap();
    result
        .expect_err(sql)
        .code()
        .cloned()
        .expect("a database error")
}

/// Asserts that `result` is the refusal of an action for want of `grant`, naming the
/// grant's function and the role.
fn needs<T: std::fmt::Debug>(result: pgbus::Result<T>, grant: pgbus::Grant, role: &str) {
    let err = result.expect_err("the action should have been refused");
    let message = err.to_string();
    match &err {
        Error::NeedsGrant {
            grant: g, role: r, ..
        } => {
            assert_eq!((*g, r.as_deref()), (grant, Some(role)), "{message}");
        }
        other => panic!("not NeedsGrant: {other:?}"),
    }
    assert_eq!(err.code(), Some(&SqlState::INSUFFICIENT_PRIVILEGE));
    match grant.function() {
        Some(f) => assert!(
            message.contains(&format!("SELECT {f}('{role}')")),
            "{message}"
        ),
        None => assert!(message.contains("the schema's owner"), "{message}"),
    }
}

/// Dead letters of an unordered subscription (`u`: u1, u2) and two keys of an ordered
/// one blocked by a dead head (`o`: k1 = o1 then o2, k2 = o3 then o4).
async fn dead_letters_and_blocked_keys(admin: &Client) {
    admin
        .batch_execute(
            "INSERT INTO pgbus.subscriptions (name, patterns, ordered) VALUES
               ('o', '{o.*}', true), ('u', '{u.*}', false);
             SELECT pgbus.publish('o.x', '{}', id => 'o1', ordering_key => 'k1');
             SELECT pgbus.publish('o.x', '{}', id => 'o2', ordering_key => 'k1');
             SELECT pgbus.publish('o.x', '{}', id => 'o3', ordering_key => 'k2');
             SELECT pgbus.publish('o.x', '{}', id => 'o4', ordering_key => 'k2');
             SELECT pgbus.publish('u.x', '{}', id => 'u1');
             SELECT pgbus.publish('u.x', '{}', id => 'u2');",
        )
        .await
        .unwrap();
    common::fan_out(admin).await;
    admin
        .batch_execute(
            "UPDATE pgbus.deliveries SET status = 'dead', attempts = 5, last_error = 'boom'
             WHERE subscription = 'u' OR is_head;",
        )
        .await
        .unwrap();
}

/// A delivery's state: `status attempts head`, or `gone`.
async fn delivery(admin: &Client, sub: &str, id: &str) -> String {
    admin
        .query_opt(
            "SELECT d.status || ' ' || d.attempts || ' ' || d.is_head
             FROM pgbus.deliveries AS d JOIN pgbus.events AS e ON e.seq = d.event_seq
             WHERE d.subscription = $1 AND e.id = $2",
            &[&sub, &id],
        )
        .await
        .unwrap()
        .map_or("gone".to_owned(), |r| r.get(0))
}

/// A consumer can no longer change what is not its own deliveries' progress: no direct
/// write, no row or table lock beyond ACCESS SHARE, no operator action. A publisher can
/// lock neither the log's rows nor the log. Each operator action names the grant it
/// needs, and every refused attempt leaves every table as it was.
#[tokio::test]
async fn consumers_and_publishers_cannot_operate_nor_lock_the_bus() {
    let db = common::test_db().await;
    let h = Hostile::new(&db).await;
    dead_letters_and_blocked_keys(&h.admin).await;
    let before = h.tables().await;
    let denied = SqlState::INSUFFICIENT_PRIVILEGE;

    let mut consumer_sql: Vec<String> = [
        "UPDATE pgbus.subscriptions SET max_attempts = 1",
        "UPDATE pgbus.subscriptions SET ordered = false WHERE name = 'o'",
        "INSERT INTO pgbus.subscriptions (name, patterns) VALUES ('sneaky', '{*}')",
        "DELETE FROM pgbus.subscriptions",
        "UPDATE pgbus.deliveries SET status = 'pending'",
        "DELETE FROM pgbus.deliveries WHERE status = 'dead'",
        "DELETE FROM pgbus.delivery_failures",
        "UPDATE pgbus.consumers SET awake = true",
        "DELETE FROM pgbus.consumers",
        "SELECT * FROM pgbus.purge_dead(NULL, NULL)",
        "SELECT * FROM pgbus.retry_dead(NULL, NULL)",
        "SELECT * FROM pgbus.replay('u', '-infinity', NULL, NULL)",
        "SELECT * FROM pgbus.skip_dead_head('o', 'k2')",
        "SELECT * FROM pgbus.redrive_head('o', 'k1')",
        "SELECT * FROM pgbus.ensure_heads('{o}', '{k1}')",
        "SELECT * FROM pgbus.configure_subscription('u', p_max_attempts => 1)",
        "SELECT * FROM pgbus.try_configure_subscription('u', NULL, 1, NULL, NULL, 10)",
        "SELECT pgbus.lock_keys('{o}', '{k1}')",
        "SELECT pgbus.lock_config(true)",
        "SELECT pgbus.lock_config(false)",
        "SELECT * FROM pgbus.settle_unlocked('{o}', '{1}', '{1}', '{}', '{}', '{}', '{}', '{}', '{}', '{}', '{}', '{}', 'w')",
        "SELECT * FROM pgbus.publish_event('x', 'a.b', 1, NULL, NULL, NULL, NULL, NULL, NULL, '{}', '{}', NULL, 0, NULL)",
    ]
    .map(str::to_owned)
    .to_vec();
    for lock in ROW_LOCKS {
        for table in [
            "deliveries",
            "subscriptions",
            "consumers",
            "events",
            "delivery_failures",
        ] {
            consumer_sql.push(format!("SELECT 1 FROM pgbus.{table} {lock}"));
        }
    }
    for table in [
        "deliveries",
        "subscriptions",
        "consumers",
        "delivery_failures",
        "events",
        "settings",
        "config_gate",
        "key_stripes",
        "duties",
    ] {
        for mode in ["ACCESS EXCLUSIVE", "EXCLUSIVE", "SHARE", "ROW EXCLUSIVE"] {
            consumer_sql.push(format!("LOCK TABLE pgbus.{table} IN {mode} MODE"));
        }
    }
    for sql in &consumer_sql {
        assert_eq!(refused(&h.consumer, sql).await, denied, "consumer: {sql}");
    }

    let mut publisher_sql: Vec<String> = [
        "UPDATE pgbus.events SET id = id",
        "LOCK TABLE pgbus.events",
        "SELECT * FROM pgbus.claim('{o,u}', '{10,10}', 10, 60000, 'w', 1, 1000000)",
        "SELECT pgbus.extend_leases('{}', '{}', '{}', 1000, 'w')",
        "SELECT pgbus.heartbeat('w', 1000, '{u}', 'x', true)",
        "SELECT * FROM pgbus.purge_dead(NULL, NULL)",
        "SELECT * FROM pgbus.redrive_head('o', 'k1')",
    ]
    .map(str::to_owned)
    .to_vec();
    for lock in ROW_LOCKS {
        publisher_sql.push(format!("SELECT 1 FROM pgbus.events {lock}"));
        publisher_sql.push(format!("SELECT 1 FROM pgbus.events WHERE id = 'o1' {lock}"));
    }
    for mode in [
        "ACCESS EXCLUSIVE",
        "EXCLUSIVE",
        "SHARE ROW EXCLUSIVE",
        "SHARE",
        "SHARE UPDATE EXCLUSIVE",
        "ROW SHARE",
    ] {
        publisher_sql.push(format!("LOCK TABLE pgbus.events IN {mode} MODE"));
    }
    for sql in &publisher_sql {
        assert_eq!(refused(&h.publisher, sql).await, denied, "publisher: {sql}");
    }

    // The library's operator actions, as the consumer: each names the operator grant.
    let c = &h.consumer;
    let role = h.consumer_name();
    let op = pgbus::Grant::Operator;
    let all = pgbus::admin::DeadLetterFilter::all();
    needs(pgbus::admin::purge_dead_letters(c, &all).await, op, role);
    needs(pgbus::admin::retry_dead_letters(c, &all).await, op, role);
    let since = chrono::DateTime::<chrono::Utc>::UNIX_EPOCH;
    needs(
        pgbus::admin::replay(c, "u", since, None, None).await,
        op,
        role,
    );
    let change = pgbus::admin::SubscriptionChange::new().max_attempts(1);
    needs(
        pgbus::admin::configure_subscription(c, "u", &change).await,
        op,
        role,
    );
    needs(pgbus::ordering::redrive_head(c, "o", "k1").await, op, role);
    needs(pgbus::ordering::skip_head(c, "o", "k2").await, op, role);
    needs(pgbus::admin::pause_subscription(c, "u").await, op, role);
    needs(
        pgbus::ordering::skip_seen_head(c, "o", "k2", "o3").await,
        op,
        role,
    );
    needs(
        pgbus::ordering::redrive_seen_head(c, "o", "k1", "o1").await,
        op,
        role,
    );
    needs(pgbus::admin::resume_subscription(c, "u").await, op, role);
    needs(
        pgbus::admin::drop_subscription(c, "u", true).await,
        pgbus::Grant::Owner,
        role,
    );
    assert_eq!(h.tables().await, before);
}

/// An operator does each operator action, and nothing a consumer or the owner does.
#[tokio::test]
async fn an_operator_retries_purges_replays_reconfigures_redrives_and_skips() {
    let db = common::test_db().await;
    let admin = db.connect().await;
    let roles = granted(&db, &admin, &["operator"]).await;
    let role = &roles.names[0];
    let op = connect(&as_role(&db.config(), role)).await.unwrap();
    dead_letters_and_blocked_keys(&admin).await;

    let u1 = pgbus::admin::DeadLetterFilter::all()
        .subscription("u")
        .event_id("u1");
    assert_eq!(pgbus::admin::retry_dead_letters(&op, &u1).await.unwrap(), 1);
    assert_eq!(delivery(&admin, "u", "u1").await, "pending 0 true");
    let u = pgbus::admin::DeadLetterFilter::all().subscription("u");
    let purged = pgbus::admin::purge_dead_letters(&op, &u).await.unwrap();
    assert_eq!(purged.dead_letters, 1);
    assert_eq!(delivery(&admin, "u", "u2").await, "gone");
    let since = chrono::DateTime::<chrono::Utc>::UNIX_EPOCH;
    let replayed = pgbus::admin::replay(&op, "u", since, None, None)
        .await
        .unwrap();
    assert_eq!((replayed.matched, replayed.created), (2, 1));
    assert_eq!(delivery(&admin, "u", "u2").await, "pending 0 true");
    let change = pgbus::admin::SubscriptionChange::new().max_attempts(3);
    assert_eq!(
        pgbus::admin::configure_subscription(&op, "u", &change)
            .await
            .unwrap(),
        Some(0)
    );
    assert_eq!(
        pgbus::admin::subscription_settings(&op, "u")
            .await
            .unwrap()
            .unwrap()
            .max_attempts,
        3
    );
    assert!(pgbus::ordering::redrive_head(&op, "o", "k1").await.unwrap());
    assert_eq!(delivery(&admin, "o", "o1").await, "pending 0 true");
    assert!(pgbus::ordering::skip_head(&op, "o", "k2").await.unwrap());
    assert_eq!(delivery(&admin, "o", "o3").await, "dead 5 false");
    assert_eq!(delivery(&admin, "o", "o4").await, "pending 0 true");
    let paused = pgbus::admin::pause_subscription(&op, "u").await.unwrap();
    assert!(!paused.already);
    let resumed = pgbus::admin::resume_subscription(&op, "u").await.unwrap();
    assert_eq!(resumed.paused_since, Some(paused.since));
    // The status and the dead letters read as the operator.
    pgbus::admin::status(&op).await.unwrap();
    pgbus::admin::dead_letters(&op, &pgbus::admin::DeadLetterFilter::all(), 10)
        .await
        .unwrap();

    // Not a consumer's, not the owner's.
    let denied = SqlState::INSUFFICIENT_PRIVILEGE;
    for sql in [
        "SELECT * FROM pgbus.claim('{o,u}', '{10,10}', 10, 60000, 'w', 1, 1000000)",
        "SELECT pgbus.heartbeat('w', 1000, '{u}', 'x', true)",
        "UPDATE pgbus.subscriptions SET max_attempts = 1",
        "DELETE FROM pgbus.deliveries",
        "LOCK TABLE pgbus.deliveries IN ACCESS EXCLUSIVE MODE",
        "SELECT 1 FROM pgbus.deliveries FOR UPDATE",
        "UPDATE pgbus.settings SET min_retention = '0'",
    ] {
        assert_eq!(refused(&op, sql).await, denied, "operator: {sql}");
    }
    needs(
        pgbus::admin::drop_subscription(&op, "u", true).await,
        pgbus::Grant::Owner,
        role,
    );
}

/// A bus running as a consumer role does all a bus does: claims, acknowledges (also in
/// the application's transaction), retries, dead-letters, extends, heartbeats, leaves.
#[tokio::test]
async fn a_consumer_runs_the_whole_bus_with_its_functions() {
    let db = common::test_db().await;
    let admin = db.connect().await;
    let roles = granted(&db, &admin, &["consumer"]).await;
    let role = &roles.names[0];
    let mut bus = Bus::builder(as_role(&db.config(), role))
        .poll_interval(Duration::from_millis(100))
        .lease(Duration::from_secs(3))
        .build()
        .unwrap();
    let mut stream = bus.subscribe("view", ["t.*"]).unwrap();
    let running = bus.start().await.unwrap();
    common::wait_for("the bus's heartbeat", WAIT, || async {
        count(&admin, "SELECT count(*) FROM pgbus.consumers").await == 1
    })
    .await;
    for name in ["t.dead", "t.in", "t.retry"] {
        pgbus::publish(&admin, &Event::new(name, json!({})).id(name))
            .await
            .unwrap();
    }
    let mut app = connect(&as_role(&db.config(), role)).await.unwrap();
    let mut retried = false;
    let mut settled = 0;
    while settled < 3 {
        let delivery = common::within("a delivery", WAIT, stream.next())
            .await
            .unwrap();
        match delivery.event().name.as_str() {
            "t.dead" => delivery.dead_letter("no").await.unwrap(),
            "t.in" => {
                let tx = app.transaction().await.unwrap();
                delivery.ack_in(&tx).await.unwrap();
                tx.commit().await.unwrap();
            }
            _ if !retried => {
                retried = true;
                delivery.retry_in(Duration::from_millis(10)).await.unwrap();
                continue;
            }
            _ => delivery.ack().await.unwrap(),
        }
        settled += 1;
    }
    common::wait_for("the settlements", WAIT, || async {
        count(&admin, "SELECT count(*) FROM pgbus.deliveries").await == 1
    })
    .await;
    assert_eq!(
        count(
            &admin,
            "SELECT count(*) FROM pgbus.deliveries AS d JOIN pgbus.events AS e
             ON e.seq = d.event_seq WHERE e.id = 't.dead' AND d.status = 'dead'"
        )
        .await,
        1
    );
    let stats = running.stats();
    assert_eq!((stats.claim_errors, stats.settle_errors), (0, 0));
    running.shutdown().await.unwrap();
    assert_eq!(
        count(&admin, "SELECT count(*) FROM pgbus.consumers").await,
        0
    );
}

/// A database migrated with earlier versions' grants: after migration 17 its consumers
/// and publishers have exactly the new grants' rights.
#[tokio::test]
async fn an_upgrade_narrows_the_grants_of_earlier_versions() {
    let db = common::test_db().await;
    let admin = db.connect().await;
    let roles = Roles::create(db.config(), &["publisher", "consumer"]).await;
    let (publisher, consumer) = (&roles.names[0], &roles.names[1]);
    let (before, after) = pgbus::schema::MIGRATIONS.split_at(16);
    assert_eq!(after[0].version, 17);
    admin
        .batch_execute("DROP SCHEMA pgbus CASCADE; CREATE SCHEMA pgbus")
        .await
        .unwrap();
    let apply = |m: &pgbus::schema::Migration| {
        format!(
            "BEGIN; SET LOCAL search_path = pg_catalog, pgbus, pg_temp;\n{}\n;COMMIT",
            m.sql
        )
    };
    for m in before {
        admin.batch_execute(&apply(m)).await.unwrap();
    }
    grant(
        &admin,
        [
            (publisher.as_str(), "publisher"),
            (consumer.as_str(), "consumer"),
        ],
    )
    .await;
    // What the earlier grants gave (so that this test can fail).
    let old = privileges(&admin, consumer).await;
    assert!(old.contains(&"deliveries UPDATE".to_owned()), "{old:?}");
    assert!(old.contains(&"config_gate UPDATE".to_owned()), "{old:?}");
    let old = privileges(&admin, publisher).await;
    assert!(old.contains(&"events(id) UPDATE".to_owned()), "{old:?}");

    for m in after {
        admin.batch_execute(&apply(m)).await.unwrap();
    }
    assert_eq!(privileges(&admin, publisher).await, PUBLISHER);
    assert_eq!(privileges(&admin, consumer).await, CONSUMER);
    let c = connect(&as_role(&db.config(), consumer)).await.unwrap();
    assert_eq!(
        refused(&c, "LOCK TABLE pgbus.deliveries IN ACCESS EXCLUSIVE MODE").await,
        SqlState::INSUFFICIENT_PRIVILEGE
    );
}
