//! The PgBouncer fixture is as hostile as it promises: transaction mode over several
//! server connections, nothing a transaction leaves on its connection survives it, and a
//! client that sends the startup parameter `options` is refused.

use pgbus_testkit::pgbouncer;
use pgbus_testkit::{connect, test_db};

#[tokio::test]
async fn a_client_that_sends_startup_options_is_refused() {
    let db = test_db().await;
    let pooler = pgbouncer::shared().await;
    let mut config = pooler.config_for(db.name());
    config.options("-c statement_timeout=5000");
    let e = connect(&config)
        .await
        .expect_err("the pooler took a client with startup options");
    assert!(
        e.as_db_error().is_some_and(|db| db
            .message()
            .contains("unsupported startup parameter: options")),
        "{e:?}"
    );
    // Without them, the same client gets in.
    let client = connect(&pooler.config_for(db.name())).await.unwrap();
    client.simple_query("SELECT 1").await.unwrap();
}

#[tokio::test]
async fn a_named_statement_or_a_set_does_not_outlive_its_transaction() {
    let db = test_db().await;
    let pooler = pgbouncer::shared().await;
    let client = connect(&pooler.config_for(db.name())).await.unwrap();

    // Prepared outside a transaction: the Sync that ends the preparation ends the
    // transaction, the server connection is reset, and the statement is gone.
    let statement = client.prepare("SELECT 1::int4").await.unwrap();
    let e = client
        .query(&statement, &[])
        .await
        .expect_err("a named statement outlived its transaction");
    assert!(
        e.as_db_error()
            .is_some_and(|db| db.message().contains("does not exist")),
        "{e:?}"
    );

    client
        .batch_execute("SET statement_timeout = '4321ms'")
        .await
        .unwrap();
    let rows = client.simple_query("SHOW statement_timeout").await.unwrap();
    let value = rows
        .iter()
        .find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(row) => row.get(0).map(str::to_owned),
            _ => None,
        })
        .unwrap();
    assert_ne!(value, "4321ms", "a session SET outlived its transaction");

    // Inside one transaction, the same statement works: it is the pooler, not the
    // statement, that forgets.
    let mut client = client;
    let tx = client.transaction().await.unwrap();
    let statement = tx.prepare("SELECT 1::int4").await.unwrap();
    let one: i32 = tx.query_one(&statement, &[]).await.unwrap().get(0);
    assert_eq!(one, 1);
    tx.commit().await.unwrap();
}

#[tokio::test]
async fn concurrent_transactions_get_different_server_connections() {
    let db = test_db().await;
    let pooler = pgbouncer::shared().await;
    let mut clients = Vec::new();
    for _ in 0..3 {
        clients.push(connect(&pooler.config_for(db.name())).await.unwrap());
    }
    let mut transactions = Vec::new();
    for client in &mut clients {
        transactions.push(client.transaction().await.unwrap());
    }
    let mut pids = Vec::new();
    for tx in &transactions {
        let rows = tx
            .query_typed("SELECT pg_backend_pid()", &[])
            .await
            .unwrap();
        pids.push(rows[0].get::<_, i32>(0));
    }
    pids.sort_unstable();
    pids.dedup();
    assert_eq!(pids.len(), 3, "{pids:?}");
    // The pooler fronts the test's database, not another one.
    let name: String = transactions[0]
        .query_typed("SELECT current_database()::text", &[])
        .await
        .unwrap()[0]
        .get(0);
    assert_eq!(name, db.name());
}
