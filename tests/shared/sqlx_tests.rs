// The sqlx tests' body, included by tests/sqlx.rs (sqlx 0.9, `pgbus::sqlx`) and
// tests/sqlx08.rs (sqlx 0.8, `pgbus::sqlx08`): `driver` is the sqlx crate, `pgbus_sqlx`
// pgbus's module for it and `SqlxFailure` the `pgbus::Error` variant of its failures.

use std::time::Duration;

use futures::StreamExt;
use pgbus::{Bus, Error, Event, Published, RunningBus, Subscription};
use serde_json::json;
use driver::postgres::{PgConnectOptions, PgPoolOptions, PgSslMode};
use driver::{Connection, PgConnection, PgPool};
use tokio_postgres::config::Host;

use roles::Roles;

const WAIT: Duration = Duration::from_secs(20);

/// sqlx's options for the test's database (the same server, user and database as
/// `db.config()`).
fn options(db: &common::TestDb) -> PgConnectOptions {
    let config = db.config();
    let mut options = PgConnectOptions::new_without_pgpass().ssl_mode(PgSslMode::Disable);
    match config.get_hosts().first() {
        Some(Host::Tcp(host)) => options = options.host(host),
        Some(Host::Unix(dir)) => options = options.socket(dir),
        None => {}
    }
    if let Some(port) = config.get_ports().first() {
        options = options.port(*port);
    }
    if let Some(user) = config.get_user() {
        options = options.username(user);
    }
    if let Some(password) = config.get_password() {
        options = options.password(std::str::from_utf8(password).unwrap());
    }
    options.database(db.name())
}

async fn pool(db: &common::TestDb) -> PgPool {
    PgPoolOptions::new()
        .max_connections(4)
        .connect_with(options(db))
        .await
        .unwrap()
}

async fn connection(db: &common::TestDb) -> PgConnection {
    PgConnection::connect_with(&options(db)).await.unwrap()
}

async fn events(client: &tokio_postgres::Client) -> Vec<String> {
    client
        .query("SELECT id FROM pgbus.events ORDER BY seq", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// A started bus with one in-process subscription to `order.*`, listening.
async fn start_bus(db: &common::TestDb) -> (RunningBus, Subscription) {
    let mut bus = Bus::builder(db.config())
        .poll_interval(Duration::from_secs(30))
        .build()
        .unwrap();
    let stream = bus.subscribe("orders", ["order.*"]).unwrap();
    let running = bus.start().await.unwrap();
    common::wait_for("the listener to connect", WAIT, || async {
        running.is_listening()
    })
    .await;
    (running, stream)
}

/// The next delivery's event id, acknowledged.
async fn next_id(stream: &mut Subscription) -> String {
    let delivery = common::within("a delivery", WAIT, stream.next())
        .await
        .expect("the stream ended");
    let id = delivery.event().id.clone();
    delivery.ack().await.unwrap();
    id
}

#[tokio::test]
async fn an_event_published_in_a_rolled_back_sqlx_transaction_is_never_delivered() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let pool = pool(&db).await;
    let (running, mut stream) = start_bus(&db).await;

    let mut tx = pool.begin().await.unwrap();
    let outcome = pgbus_sqlx::publish(
        &mut *tx,
        &Event::new("order.cancelled", json!({})).id("rolled-back"),
    )
    .await
    .unwrap();
    assert_eq!(outcome, Published::Inserted);
    tx.rollback().await.unwrap();
    assert!(events(&client).await.is_empty());

    // A marker committed after it: once the marker is delivered, the rolled-back event,
    // older, would have been delivered before it.
    let mut tx = pool.begin().await.unwrap();
    pgbus_sqlx::publish(
        &mut *tx,
        &Event::new("order.placed", json!({})).id("marker"),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(next_id(&mut stream).await, "marker");
    assert_eq!(events(&client).await, ["marker"]);
    common::wait_settled(&client, "the marker's delivery").await;
    running.shutdown().await.unwrap();
}

#[tokio::test]
async fn an_event_published_in_a_committed_sqlx_transaction_is_delivered() {
    let db = common::test_db().await;
    let client = db.connect().await;
    client
        .batch_execute("CREATE TABLE orders (id bigint PRIMARY KEY, state text NOT NULL)")
        .await
        .unwrap();
    let pool = pool(&db).await;
    let (running, mut stream) = start_bus(&db).await;

    let mut tx = pool.begin().await.unwrap();
    driver::query("INSERT INTO orders (id, state) VALUES ($1, 'placed')")
        .bind(42_i64)
        .execute(&mut *tx)
        .await
        .unwrap();
    let event = Event::new("order.placed", json!({"order_id": 42}))
        .id("order-42-placed")
        .aggregate("order", "42");
    pgbus_sqlx::publish(&mut *tx, &event).await.unwrap();
    tx.commit().await.unwrap();

    let delivery = common::within("the delivery", WAIT, stream.next())
        .await
        .unwrap();
    assert_eq!(delivery.event().id, "order-42-placed");
    assert_eq!(delivery.event().payload, json!({"order_id": 42}));
    assert_eq!(delivery.event().aggregate_id.as_deref(), Some("42"));
    delivery.ack().await.unwrap();
    common::wait_settled(&client, "the delivery").await;
    running.shutdown().await.unwrap();
}

#[tokio::test]
async fn every_kind_of_sqlx_executor_publishes() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let pool = pool(&db).await;
    let mut conn = connection(&db).await;

    let mut tx = pool.begin().await.unwrap();
    let in_tx = pgbus_sqlx::publish(&mut *tx, &Event::new("order.a", json!(1)).id("tx"))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let on_connection =
        pgbus_sqlx::publish(&mut conn, &Event::new("order.b", json!(2)).id("connection"))
            .await
            .unwrap();
    let on_pool = pgbus_sqlx::publish(&pool, &Event::new("order.c", json!(3)).id("pool"))
        .await
        .unwrap();
    let mut pooled = pool.acquire().await.unwrap();
    let on_pooled =
        pgbus_sqlx::publish(&mut *pooled, &Event::new("order.d", json!(4)).id("pooled"))
            .await
            .unwrap();
    let mut conn_tx = conn.begin().await.unwrap();
    let batch = pgbus_sqlx::publish_batch(
        &mut *conn_tx,
        &[Event::new("order.e", json!(5)).id("connection-tx")],
    )
    .await
    .unwrap();
    conn_tx.commit().await.unwrap();

    assert_eq!(
        [in_tx, on_connection, on_pool, on_pooled],
        [Published::Inserted; 4]
    );
    assert_eq!(batch, 1);
    assert_eq!(
        events(&client).await,
        ["tx", "connection", "pool", "pooled", "connection-tx"]
    );
}

#[tokio::test]
async fn a_batch_published_through_sqlx_is_delivered_whole_in_seq_order() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let pool = pool(&db).await;
    let (running, mut stream) = start_bus(&db).await;

    let batch: Vec<Event> = (0..5)
        .map(|i| Event::new("order.placed", json!({"n": i})).id(format!("batch-{i}")))
        .collect();
    let mut tx = pool.begin().await.unwrap();
    let inserted = pgbus_sqlx::publish_batch(&mut *tx, &batch).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(inserted, 5);
    let ids: Vec<String> = batch.iter().map(|e| e.id.clone()).collect();
    assert_eq!(
        events(&client).await,
        ids,
        "the log's seq follows the batch"
    );

    let mut seen = Vec::new();
    let mut last_seq = 0;
    for _ in 0..5 {
        let delivery = common::within("the batch's deliveries", WAIT, stream.next())
            .await
            .unwrap();
        let seq = delivery.event().seq.unwrap();
        assert!(
            seq > last_seq,
            "delivered out of seq order: {seq} after {last_seq}"
        );
        last_seq = seq;
        seen.push(delivery.event().id.clone());
        delivery.ack().await.unwrap();
    }
    assert_eq!(seen, ids);
    common::wait_settled(&client, "the batch's deliveries").await;
    running.shutdown().await.unwrap();
}

#[tokio::test]
async fn the_same_id_twice_is_a_duplicate_as_through_tokio_postgres() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let pool = pool(&db).await;
    let event = Event::new("order.placed", json!({"order_id": 7})).id("order-7");

    assert_eq!(
        pgbus_sqlx::publish(&pool, &event).await.unwrap(),
        Published::Inserted
    );
    // A retry with a new correlation id is the same event.
    let retry = event.clone().correlation_id("retry");
    assert_eq!(
        pgbus_sqlx::publish(&pool, &retry).await.unwrap(),
        Published::Duplicate
    );
    assert_eq!(
        pgbus::publish(&client, &retry).await.unwrap(),
        Published::Duplicate
    );
    assert_eq!(
        pgbus_sqlx::publish_batch(&pool, &[event.clone(), event.clone()])
            .await
            .unwrap(),
        0
    );
    assert_eq!(events(&client).await, ["order-7"]);

    // Different content under the id: the same Conflict, nothing written, and the
    // transaction goes on.
    let other = Event::new("order.placed", json!({"order_id": 8})).id("order-7");
    let through_tokio = pgbus::publish(&client, &other).await.unwrap_err();
    let mut tx = pool.begin().await.unwrap();
    let through_sqlx = pgbus_sqlx::publish(&mut *tx, &other).await.unwrap_err();
    assert!(
        matches!(&through_sqlx, Error::Conflict { id } if id == "order-7"),
        "{through_sqlx:?}"
    );
    assert_eq!(through_sqlx.to_string(), through_tokio.to_string());
    let batch_conflict = pgbus_sqlx::publish_batch(
        &mut *tx,
        &[Event::new("order.shipped", json!({})).id("new"), other],
    )
    .await
    .unwrap_err();
    assert!(batch_conflict.is_conflict(), "{batch_conflict:?}");
    pgbus_sqlx::publish(&mut *tx, &Event::new("order.paid", json!({})).id("after"))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(events(&client).await, ["order-7", "after"]);
}

#[tokio::test]
async fn an_invalid_event_is_refused_before_anything_is_sent() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let pool = pool(&db).await;
    let bad = Event::new("bad name", json!({}));
    let expected = pgbus::publish(&client, &bad).await.unwrap_err();
    assert!(
        matches!(
            expected,
            Error::Invalid {
                what: "event name",
                ..
            }
        ),
        "{expected:?}"
    );

    let mut tx = pool.begin().await.unwrap();
    pgbus_sqlx::publish(
        &mut *tx,
        &Event::new("order.placed", json!({})).id("before"),
    )
    .await
    .unwrap();
    let err = pgbus_sqlx::publish(&mut *tx, &bad).await.unwrap_err();
    assert!(matches!(err, Error::Invalid { .. }), "{err:?}");
    assert_eq!(err.to_string(), expected.to_string());
    let err = pgbus_sqlx::publish_batch(
        &mut *tx,
        &[
            Event::new("order.ok", json!({})).id("in-bad-batch"),
            bad.clone(),
        ],
    )
    .await
    .unwrap_err();
    assert_eq!(err.to_string(), expected.to_string());
    let nul = pgbus_sqlx::publish(&mut *tx, &Event::new("order.nul", json!({"s": "\u{0}"})))
        .await
        .unwrap_err();
    assert!(
        matches!(
            nul,
            Error::Invalid {
                what: "payload",
                ..
            }
        ),
        "{nul:?}"
    );
    // The transaction is still usable.
    pgbus_sqlx::publish(&mut *tx, &Event::new("order.placed", json!({})).id("after"))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(events(&client).await, ["before", "after"]);

    // Refused before any I/O: a closed pool is never asked for a connection.
    pool.close().await;
    let err = pgbus_sqlx::publish(&pool, &bad).await.unwrap_err();
    assert!(matches!(err, Error::Invalid { .. }), "{err:?}");
    let err = pgbus_sqlx::publish_batch(&pool, &[bad]).await.unwrap_err();
    assert!(matches!(err, Error::Invalid { .. }), "{err:?}");
    assert_eq!(pgbus_sqlx::publish_batch(&pool, &[]).await.unwrap(), 0);
}

#[tokio::test]
async fn sqlx_errors_answer_like_tokio_postgres_errors() {
    let db = common::test_db().await;
    let mut client = db.connect().await;
    let pool = pool(&db).await;
    let event = Event::new("order.placed", json!({}));

    // A lock that is not granted in time: 55P03, transient, not a connection failure.
    let holder = db.connect().await;
    holder
        .batch_execute("BEGIN; LOCK TABLE pgbus.events IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let tx = client.transaction().await.unwrap();
    tx.batch_execute("SET LOCAL lock_timeout = '50ms'")
        .await
        .unwrap();
    let through_tokio = pgbus::publish(&tx, &event).await.unwrap_err();
    tx.rollback().await.unwrap();
    let mut sqlx_tx = pool.begin().await.unwrap();
    driver::query("SET LOCAL lock_timeout = '50ms'")
        .execute(&mut *sqlx_tx)
        .await
        .unwrap();
    let through_sqlx = pgbus_sqlx::publish(&mut *sqlx_tx, &event)
        .await
        .unwrap_err();
    sqlx_tx.rollback().await.unwrap();
    holder.batch_execute("ROLLBACK").await.unwrap();
    assert!(matches!(through_sqlx, SqlxFailure(_)), "{through_sqlx:?}");
    assert_eq!(through_sqlx.code().map(|c| c.code()), Some("55P03"));
    assert_eq!(through_sqlx.code(), through_tokio.code());
    assert!(through_sqlx.is_transient() && through_tokio.is_transient());
    assert!(!through_sqlx.is_connection() && !through_tokio.is_connection());
    assert!(
        through_sqlx.to_string().contains("(SQLSTATE 55P03)"),
        "{through_sqlx}"
    );

    // A database never migrated: the same SQLSTATE, and the message says to migrate.
    client
        .batch_execute("DROP SCHEMA pgbus CASCADE")
        .await
        .unwrap();
    let through_tokio = pgbus::publish(&client, &event).await.unwrap_err();
    let through_sqlx = pgbus_sqlx::publish(&pool, &event).await.unwrap_err();
    assert!(matches!(through_tokio, Error::SchemaMissing(_)));
    assert_eq!(through_sqlx.code(), through_tokio.code());
    assert!(!through_sqlx.is_transient() && !through_sqlx.is_connection());
    let SqlxFailure(inner) = &through_sqlx else {
        panic!("{through_sqlx:?}");
    };
    assert!(inner.is_schema_missing());
    assert!(through_sqlx.to_string().contains("run `pgbus migrate`"));
    assert!(matches!(inner.get_ref(), driver::Error::Database(_)));

    // No connection to be had: a connection failure, worth a retry.
    pool.close().await;
    let closed = pgbus_sqlx::publish(&pool, &event).await.unwrap_err();
    assert!(
        closed.is_connection() && closed.is_transient(),
        "{closed:?}"
    );
    assert_eq!(closed.code(), None);
}

/// A list of the migrations recorded: version, name, checksum.
async fn recorded(client: &tokio_postgres::Client) -> Vec<(i32, String, String)> {
    client
        .query(
            "SELECT version, name, checksum FROM pgbus.schema_migrations ORDER BY version",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect()
}

fn versions(migrations: &[pgbus::schema::Migration]) -> Vec<i32> {
    migrations.iter().map(|m| m.version).collect()
}

#[tokio::test]
async fn sqlx_migrate_and_migrate_each_find_the_others_work_done() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let reference = recorded(&client).await;
    let all = versions(pgbus::schema::MIGRATIONS);
    let pool = pool(&db).await;

    client
        .batch_execute("DROP SCHEMA pgbus CASCADE")
        .await
        .unwrap();
    let applied = pgbus_sqlx::migrate(&pool).await.unwrap();
    assert_eq!(versions(&applied), all);
    assert_eq!(recorded(&client).await, reference);
    assert!(pgbus::migrate(&client).await.unwrap().is_empty());
    assert!(pgbus_sqlx::migrate(&pool).await.unwrap().is_empty());

    // And the other way round, on a single connection.
    client
        .batch_execute("DROP SCHEMA pgbus CASCADE")
        .await
        .unwrap();
    assert_eq!(versions(&pgbus::migrate(&client).await.unwrap()), all);
    let mut conn = connection(&db).await;
    assert!(pgbus_sqlx::migrate(&mut conn).await.unwrap().is_empty());
    assert_eq!(recorded(&client).await, reference);
    // The schema works for both publishers.
    pgbus_sqlx::publish(&mut conn, &Event::new("order.placed", json!({})).id("a"))
        .await
        .unwrap();
    pgbus::publish(&client, &Event::new("order.placed", json!({})).id("b"))
        .await
        .unwrap();
    assert_eq!(events(&client).await, ["a", "b"]);
}

#[tokio::test]
async fn two_concurrent_sqlx_migrations_both_succeed_and_apply_each_once() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let reference = recorded(&client).await;
    client
        .batch_execute("DROP SCHEMA pgbus CASCADE")
        .await
        .unwrap();
    let pool = pool(&db).await;
    let mut conn = connection(&db).await;

    let (a, b) = common::within(
        "both migrations",
        WAIT,
        futures::future::join(pgbus_sqlx::migrate(&pool), pgbus_sqlx::migrate(&mut conn)),
    )
    .await;
    migrations::assert_each_applied_once(a, b);
    assert_eq!(recorded(&client).await, reference);
}

#[tokio::test]
async fn sqlx_migrate_reports_a_changed_migration_as_drift() {
    let db = common::test_db().await;
    let client = db.connect().await;
    migrations::edit_first_migration(&client).await;
    migrations::assert_first_migration_drifted(pgbus_sqlx::migrate(&pool(&db).await).await);
    assert_eq!(
        recorded(&client).await.first().map(|r| r.2.as_str()),
        Some("edited")
    );
}

/// `current_user` and `current_database()` as sqlx sees them through `url`.
async fn sqlx_whoami(url: &str) -> (String, String) {
    let mut conn = PgConnection::connect(url)
        .await
        .unwrap_or_else(|e| panic!("sqlx refused {url}: {e}"));
    let row: (String, String) =
        driver::query_as("SELECT current_user::text, current_database()::text")
            .fetch_one(&mut conn)
            .await
            .unwrap();
    conn.close().await.unwrap();
    row
}

/// `current_user` and `current_database()` as tokio-postgres sees them through `url`.
async fn tokio_postgres_whoami(url: &str) -> (String, String) {
    let config: tokio_postgres::Config = url
        .parse()
        .unwrap_or_else(|e| panic!("tokio-postgres refused {url}: {e}"));
    let client = common::connect(&config).await.unwrap();
    let row = client
        .query_one("SELECT current_user::text, current_database()::text", &[])
        .await
        .unwrap();
    (row.get(0), row.get(1))
}

#[tokio::test]
async fn the_test_kits_url_connects_sqlx_and_tokio_postgres_to_the_test_database() {
    let db = common::test_db().await;
    let url = db.url();
    assert!(url.starts_with("postgres://"), "{url}");
    let user = db.config().get_user().unwrap().to_owned();
    let expected = (user, db.name().to_owned());
    assert_eq!(sqlx_whoami(&url).await, expected, "{url}");
    assert_eq!(tokio_postgres_whoami(&url).await, expected, "{url}");
    // A pool on it publishes, as a service's would.
    let pool = PgPool::connect(&url).await.unwrap();
    let event = Event::new("kit.url", json!({}));
    pgbus_sqlx::publish(&pool, &event).await.unwrap();
    assert_eq!(events(&db.connect().await).await, [event.id]);
}

#[tokio::test]
async fn the_test_kits_url_percent_encodes_what_both_drivers_decode() {
    let db = common::test_db().await;
    // A role whose name needs quoting and percent-encoding.
    let roles = Roles::create(db.config(), &["o'dd user@x:y/z%?&="]).await;
    let role = &roles.names[0];
    let mut config = db.config();
    // The test servers trust local connections: the password is carried, not checked.
    config.user(role).password("p@ss:w/rd %&=+'#?");
    let url = pgbus_testkit::url(&config);
    let expected = (role.clone(), db.name().to_owned());
    assert_eq!(sqlx_whoami(&url).await, expected, "{url}");
    assert_eq!(tokio_postgres_whoami(&url).await, expected, "{url}");
}

#[test]
fn the_test_kits_url_reads_back_the_same_settings_in_both_drivers() {
    let socket: tokio_postgres::Config =
        "host='/run/my sockets/pg%1' port=5433 user='me@home' dbname='a b/c?d' \
         options='-c search_path=x' application_name='kit&test'"
            .parse()
            .unwrap();
    let tcp: tokio_postgres::Config =
        "host=db.internal port=6432 user='a:b' password='p@ss w/rd' dbname=app"
            .parse()
            .unwrap();
    let ipv6: tokio_postgres::Config = "host=::1 port=5432 user=u dbname=d".parse().unwrap();
    for config in [socket, tcp, ipv6] {
        let url = pgbus_testkit::url(&config);
        let back: tokio_postgres::Config = url.parse().unwrap();
        assert_eq!(back.get_hosts(), config.get_hosts(), "{url}");
        assert_eq!(back.get_ports(), config.get_ports(), "{url}");
        assert_eq!(back.get_user(), config.get_user(), "{url}");
        assert_eq!(back.get_password(), config.get_password(), "{url}");
        assert_eq!(back.get_dbname(), config.get_dbname(), "{url}");
        assert_eq!(back.get_options(), config.get_options(), "{url}");
        assert_eq!(
            back.get_application_name(),
            config.get_application_name(),
            "{url}"
        );

        let sqlx: PgConnectOptions = url.parse().unwrap();
        match &config.get_hosts()[0] {
            Host::Tcp(host) => {
                assert_eq!(sqlx.get_host(), host, "{url}");
                assert_eq!(sqlx.get_socket(), None, "{url}");
            }
            Host::Unix(dir) => assert_eq!(sqlx.get_socket(), Some(dir), "{url}"),
        }
        assert_eq!(sqlx.get_port(), config.get_ports()[0], "{url}");
        assert_eq!(Some(sqlx.get_username()), config.get_user(), "{url}");
        assert_eq!(sqlx.get_database(), config.get_dbname(), "{url}");
        assert_eq!(sqlx.get_options(), config.get_options(), "{url}");
        assert_eq!(
            sqlx.get_application_name(),
            config.get_application_name(),
            "{url}"
        );
    }
}

/// The test's projection table: one row per event, with the attempt that wrote it.
async fn create_projection(client: &tokio_postgres::Client) {
    client
        .batch_execute("CREATE TABLE projection (event_id text PRIMARY KEY, attempt int NOT NULL)")
        .await
        .unwrap();
}

async fn projection_rows(client: &tokio_postgres::Client) -> Vec<(String, i32)> {
    let sql = "SELECT event_id, attempt FROM projection ORDER BY event_id";
    let rows = client.query(sql, &[]).await.unwrap();
    rows.iter().map(|r| (r.get(0), r.get(1))).collect()
}

/// The delivery of the event `id`: status and attempts.
async fn delivery_of(client: &tokio_postgres::Client, id: &str) -> Option<(String, i32)> {
    client
        .query_opt(
            "SELECT d.status, d.attempts FROM pgbus.deliveries AS d
             JOIN pgbus.events AS e ON e.seq = d.event_seq WHERE e.id = $1",
            &[&id],
        )
        .await
        .unwrap()
        .map(|r| (r.get(0), r.get(1)))
}

/// Every failed attempt's error, in no particular order.
async fn failures(client: &tokio_postgres::Client) -> Vec<String> {
    let rows = client
        .query("SELECT error FROM pgbus.delivery_failures", &[])
        .await
        .unwrap();
    rows.iter().map(|r| r.get(0)).collect()
}

/// A handler that writes its projection row through a sqlx pool and completes its
/// delivery in the same sqlx transaction; on attempt 1 of an event whose payload says so,
/// it rolls back instead (after `ack_in`) and fails.
fn sqlx_projector(
    pool: PgPool,
    calls: tokio::sync::mpsc::UnboundedSender<(String, i32)>,
) -> impl Fn(
    Event,
    pgbus::Context,
) -> futures::future::BoxFuture<'static, Result<(), pgbus::HandlerError>>
+ Send
+ Sync
+ 'static {
    move |event: Event, cx: pgbus::Context| {
        let pool = pool.clone();
        let calls = calls.clone();
        Box::pin(async move {
            let _ = calls.send((event.id.clone(), cx.attempt()));
            let mut tx = pool.begin().await?;
            driver::query("INSERT INTO projection (event_id, attempt) VALUES ($1, $2)")
                .bind(&event.id)
                .bind(cx.attempt())
                .execute(&mut *tx)
                .await?;
            pgbus_sqlx::ack_in(&mut tx, &cx).await?;
            if event.payload["roll_back_first"] == json!(true) && cx.attempt() == 1 {
                tx.rollback().await?;
                return Err(pgbus::HandlerError::new("rolled back on purpose"));
            }
            tx.commit().await?;
            Ok(())
        })
    }
}

#[tokio::test]
async fn a_handlers_sqlx_ack_in_commits_with_its_projection_and_is_not_acked_again() {
    let db = common::test_db().await;
    let client = db.connect().await;
    create_projection(&client).await;
    let (calls_tx, mut calls) = tokio::sync::mpsc::unbounded_channel();
    let running = Bus::builder(db.config())
        .handler_with_context(
            "projection",
            ["order.*"],
            sqlx_projector(pool(&db).await, calls_tx),
        )
        .build()
        .unwrap()
        .start()
        .await
        .unwrap();
    pgbus::publish(&client, &Event::new("order.placed", json!({})).id("o1"))
        .await
        .unwrap();
    common::wait_settled(&client, "the completion in the handler's transaction").await;
    assert_eq!(projection_rows(&client).await, [("o1".to_string(), 1)]);
    let stats = running.stats();
    running.shutdown().await.unwrap();
    // One call, one completion (the bus wrote no second acknowledgement, which would
    // have been rejected as stale), no failure.
    assert_eq!(calls.try_recv().unwrap(), ("o1".to_string(), 1));
    assert!(
        calls.try_recv().is_err(),
        "the delivery was delivered again"
    );
    assert_eq!(
        (stats.delivered, stats.stale_rejected, stats.failed),
        (1, 0, 0)
    );
    assert!(failures(&client).await.is_empty());
}

#[tokio::test]
async fn a_handlers_sqlx_ack_in_rolled_back_leaves_no_row_and_the_delivery_comes_again() {
    let db = common::test_db().await;
    let client = db.connect().await;
    create_projection(&client).await;
    let (calls_tx, mut calls) = tokio::sync::mpsc::unbounded_channel();
    let running = Bus::builder(db.config())
        .retry(pgbus::RetryPolicy::fixed(Duration::from_millis(10)))
        // The retry must not wait for the lease: the handler's error brings it back.
        .lease(Duration::from_secs(600))
        .handler_with_context(
            "projection",
            ["order.*"],
            sqlx_projector(pool(&db).await, calls_tx),
        )
        .build()
        .unwrap()
        .start()
        .await
        .unwrap();
    pgbus::publish(
        &client,
        &Event::new("order.placed", json!({"roll_back_first": true})).id("o1"),
    )
    .await
    .unwrap();
    let mut recv = async || {
        common::within("a handler call", WAIT, calls.recv())
            .await
            .unwrap()
    };
    assert_eq!(recv().await, ("o1".to_string(), 1));
    assert_eq!(recv().await, ("o1".to_string(), 2));
    common::wait_settled(&client, "attempt 2's completion").await;
    // Attempt 1's row rolled back with its completion; attempt 2's committed with its.
    assert_eq!(projection_rows(&client).await, [("o1".to_string(), 2)]);
    assert_eq!(failures(&client).await, ["rolled back on purpose"]);
    running.shutdown().await.unwrap();
}

/// The next delivery of a stream, not settled.
async fn next_delivery(stream: &mut Subscription) -> pgbus::Delivery {
    common::within("a delivery", WAIT, stream.next())
        .await
        .expect("the stream ended")
}

#[tokio::test]
async fn a_streams_sqlx_ack_in_commits_with_the_projection_or_after_a_rollback_comes_again() {
    let db = common::test_db().await;
    let client = db.connect().await;
    create_projection(&client).await;
    let pool = pool(&db).await;
    let mut bus = Bus::builder(db.config())
        .poll_interval(Duration::from_millis(100))
        .lease(Duration::from_secs(1))
        .build()
        .unwrap();
    let mut stream = bus.subscribe("projection", ["order.*"]).unwrap();
    let running = bus.start().await.unwrap();
    pgbus::publish_batch(
        &client,
        &[
            Event::new("order.placed", json!({})).id("kept"),
            Event::new("order.placed", json!({})).id("rolled-back"),
        ],
    )
    .await
    .unwrap();
    let mut held = std::collections::HashMap::new();
    for _ in 0..2 {
        let d = next_delivery(&mut stream).await;
        held.insert(d.event().id.clone(), d);
    }

    let d = held.remove("kept").unwrap();
    let mut tx = pool.begin().await.unwrap();
    driver::query("INSERT INTO projection VALUES ('kept', $1)")
        .bind(d.attempt())
        .execute(&mut *tx)
        .await
        .unwrap();
    pgbus_sqlx::ack_delivery_in(&mut tx, d).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(delivery_of(&client, "kept").await, None);

    let d = held.remove("rolled-back").unwrap();
    let mut tx = pool.begin().await.unwrap();
    driver::query("INSERT INTO projection VALUES ('rolled-back', 1)")
        .execute(&mut *tx)
        .await
        .unwrap();
    pgbus_sqlx::ack_delivery_in(&mut tx, d).await.unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(projection_rows(&client).await, [("kept".to_string(), 1)]);
    // Still leased to this bus, no longer extended: it comes back once the lease ran out.
    let again = next_delivery(&mut stream).await;
    assert_eq!(
        (again.event().id.as_str(), again.attempt()),
        ("rolled-back", 2)
    );
    let errors = failures(&client).await;
    assert_eq!(errors.len(), 1);
    assert!(errors[0].starts_with("lease expired"), "{errors:?}");
    let mut tx = pool.begin().await.unwrap();
    driver::query("INSERT INTO projection VALUES ('rolled-back', 2)")
        .execute(&mut *tx)
        .await
        .unwrap();
    pgbus_sqlx::ack_delivery_in(&mut tx, again).await.unwrap();
    tx.commit().await.unwrap();
    common::wait_settled(&client, "both completions").await;
    assert_eq!(
        projection_rows(&client).await,
        [("kept".to_string(), 1), ("rolled-back".to_string(), 2)]
    );
    assert_eq!(running.stats().delivered, 3);
    running.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_sqlx_ack_in_on_a_lost_lease_fails_and_the_transaction_cannot_commit_its_writes() {
    let db = common::test_db().await;
    let client = db.connect().await;
    create_projection(&client).await;
    let pool = pool(&db).await;
    let mut bus = Bus::builder(db.config())
        .poll_interval(Duration::from_millis(100))
        .build()
        .unwrap();
    let mut stream = bus.subscribe("projection", ["*"]).unwrap();
    let running = bus.start().await.unwrap();
    pgbus::publish(&client, &Event::new("x", json!({})).id("x"))
        .await
        .unwrap();
    let stale = next_delivery(&mut stream).await;
    assert_eq!(stale.attempt(), 1);

    // The lease runs out; the reaper returns the delivery and it is claimed again.
    client
        .batch_execute("UPDATE pgbus.deliveries SET locked_until = now() - interval '1 second'")
        .await
        .unwrap();
    let current = next_delivery(&mut stream).await;
    assert_eq!(current.attempt(), 2);

    let mut tx = pool.begin().await.unwrap();
    driver::query("INSERT INTO projection VALUES ('x', 1)")
        .execute(&mut *tx)
        .await
        .unwrap();
    let result = pgbus_sqlx::ack_delivery_in(&mut tx, stale).await;
    assert!(matches!(result, Err(Error::LeaseLost)), "{result:?}");
    // The statement's error aborted the transaction: nothing it wrote can commit.
    let more = driver::query("INSERT INTO projection VALUES ('y', 1)")
        .execute(&mut *tx)
        .await
        .map_err(Error::from);
    assert_eq!(
        more.unwrap_err().code(),
        Some(&tokio_postgres::error::SqlState::IN_FAILED_SQL_TRANSACTION)
    );
    let _ = tx.commit().await;
    assert!(projection_rows(&client).await.is_empty());
    // The current holder's lease is untouched.
    assert_eq!(
        delivery_of(&client, "x").await,
        Some(("processing".to_string(), 2))
    );
    current.ack().await.unwrap();
    common::wait_settled(&client, "the current holder's completion").await;
    assert_eq!(running.stats().stale_rejected, 1);
    running.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_sqlx_ack_in_in_an_ordered_subscription_hands_the_key_to_its_next_event_at_commit() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let pool = pool(&db).await;
    let mut bus = Bus::builder(db.config()).build().unwrap();
    let mut stream = bus
        .subscribe_with(
            "ordered",
            ["*"],
            pgbus::SubscriptionOptions::new().ordered(true),
        )
        .unwrap();
    let running = bus.start().await.unwrap();
    pgbus::publish_batch(
        &client,
        &[
            Event::new("x", json!({})).id("first").ordering_key("k"),
            Event::new("x", json!({})).id("second").ordering_key("k"),
        ],
    )
    .await
    .unwrap();
    let first = next_delivery(&mut stream).await;
    assert_eq!(first.event().id, "first");

    let mut tx = pool.begin().await.unwrap();
    pgbus_sqlx::ack_delivery_in(&mut tx, first).await.unwrap();
    // Not before the commit: the head is still the first event, for everyone else.
    assert_eq!(
        delivery_of(&client, "first").await.map(|d| d.0),
        Some("processing".to_string())
    );
    tx.commit().await.unwrap();
    let second = next_delivery(&mut stream).await;
    assert_eq!(
        (second.event().id.as_str(), second.attempt()),
        ("second", 1)
    );
    assert_eq!(delivery_of(&client, "first").await, None);
    second.ack().await.unwrap();
    common::wait_settled(&client, "the second event").await;
    running.shutdown().await.unwrap();
}
