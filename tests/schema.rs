//! Migrations: idempotent, safe to run concurrently, and checked against drift.

mod common;
#[path = "shared/migrations.rs"]
mod migrations;

/// A description of every pgbus object, to compare schemas.
async fn describe(client: &tokio_postgres::Client) -> Vec<String> {
    client
        .query(
            "SELECT 'column ' || table_name || '.' || column_name || ' ' || data_type || ' ' || coalesce(column_default, '') \
               FROM information_schema.columns WHERE table_schema = 'pgbus' \
             UNION ALL SELECT 'index ' || indexdef FROM pg_indexes WHERE schemaname = 'pgbus' \
             UNION ALL SELECT 'trigger ' || tgname || ' ' || pg_get_triggerdef(t.oid) FROM pg_trigger t \
               JOIN pg_class c ON c.oid = t.tgrelid JOIN pg_namespace n ON n.oid = c.relnamespace \
               WHERE n.nspname = 'pgbus' AND NOT t.tgisinternal \
             UNION ALL SELECT 'function ' || p.oid::regprocedure::text || ' ' || md5(p.prosrc) FROM pg_proc p \
               JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = 'pgbus' \
             UNION ALL SELECT 'constraint ' || conname || ' ' || pg_get_constraintdef(oid) FROM pg_constraint \
               WHERE connamespace = 'pgbus'::regnamespace \
             UNION ALL SELECT 'migration ' || version || ' ' || name || ' ' || checksum FROM pgbus.schema_migrations \
             ORDER BY 1",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

#[tokio::test]
async fn migrate_twice_changes_nothing_the_second_time() {
    let db = common::test_db().await;
    let client = db.connect().await;
    client
        .batch_execute("DROP SCHEMA pgbus CASCADE")
        .await
        .unwrap();
    assert_eq!(pgbus::schema::schema_version(&client).await.unwrap(), None);

    let applied = pgbus::migrate(&client).await.unwrap();
    assert_eq!(
        applied.iter().map(|m| m.version).collect::<Vec<_>>(),
        pgbus::schema::MIGRATIONS
            .iter()
            .map(|m| m.version)
            .collect::<Vec<_>>()
    );
    let first = describe(&client).await;
    assert!(first.iter().any(|l| l.starts_with("trigger events_guard")));
    assert!(
        !first
            .iter()
            .any(|l| l.starts_with("trigger events_order_key")),
        "no subscription is ordered: the log has no ordering trigger"
    );

    let again = pgbus::migrate(&client).await.unwrap();
    assert!(again.is_empty(), "{again:?}");
    assert_eq!(describe(&client).await, first);
    assert_eq!(
        pgbus::schema::schema_version(&client).await.unwrap(),
        Some(pgbus::schema::latest_version())
    );
}

#[tokio::test]
async fn concurrent_migrations_from_two_connections_apply_once() {
    let db = common::test_db().await;
    let reference = describe(&db.connect().await).await;
    let client = db.connect().await;
    client
        .batch_execute("DROP SCHEMA pgbus CASCADE")
        .await
        .unwrap();

    let a = db.connect().await;
    let b = db.connect().await;
    let (ra, rb) = tokio::join!(pgbus::migrate(&a), pgbus::migrate(&b));
    migrations::assert_each_applied_once(ra, rb);
    assert_eq!(describe(&client).await, reference);
}

#[tokio::test]
async fn a_changed_migration_is_reported_as_drift() {
    let db = common::test_db().await;
    let client = db.connect().await;
    migrations::edit_first_migration(&client).await;
    migrations::assert_first_migration_drifted(pgbus::migrate(&client).await);
}

/// A SQL_ASCII database keeps text bytes unchecked, so a row pgbus could never read could
/// stop a subscription: `migrate` refuses it and writes nothing.
#[tokio::test]
async fn migrate_refuses_a_sql_ascii_database() {
    let db = common::test_db().await;
    let admin = db.connect().await;
    let name = format!("{}_ascii", db.name());
    admin
        .batch_execute(&format!(
            "CREATE DATABASE {name} TEMPLATE template0 ENCODING 'SQL_ASCII' \
             LC_COLLATE 'C' LC_CTYPE 'C'"
        ))
        .await
        .unwrap();
    let mut config = db.config();
    config.dbname(&name);
    let (client, connection) = config.connect(tokio_postgres::NoTls).await.unwrap();
    let connection = tokio::spawn(connection);
    let err = pgbus::migrate(&client).await.unwrap_err();
    assert!(
        matches!(
            &err,
            pgbus::Error::Invalid {
                what: "database encoding",
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(pgbus::schema::schema_version(&client).await.unwrap(), None);
    drop(client);
    let _ = connection.await;
    admin
        .batch_execute(&format!("DROP DATABASE {name}"))
        .await
        .unwrap();
}

/// A server older than the minimum is refused with both versions named; the minimum
/// itself and newer servers pass.
#[test]
fn the_server_version_check_names_both_versions() {
    use pgbus::schema::{MIN_SERVER_VERSION, check_server_version};

    for ok in [MIN_SERVER_VERSION, 150_014, 180_006, 990_000] {
        check_server_version(ok).unwrap_or_else(|e| panic!("{ok}: {e}"));
    }
    for old in [MIN_SERVER_VERSION - 1, 120_022, 90_624] {
        let err = check_server_version(old).unwrap_err();
        assert!(
            matches!(err, pgbus::Error::UnsupportedServer { version, minimum }
                if version == old && minimum == MIN_SERVER_VERSION),
            "{err:?}"
        );
    }
    let message = |version| check_server_version(version).unwrap_err().to_string();
    assert_eq!(
        message(120_022),
        "PostgreSQL 12.22 is not supported: pgbus needs PostgreSQL 13 or newer"
    );
    assert_eq!(
        message(90_624),
        "PostgreSQL 9.6.24 is not supported: pgbus needs PostgreSQL 13 or newer"
    );
}

/// The server the tests run on passes the check, and `migrate` reads its version.
/// `PGBUS_TEST_SERVER_MAJOR` (set by `.ci/run` for each of its runs) makes sure the
/// tests ran on the server meant, not on one left running by an earlier run.
#[tokio::test]
async fn migrate_accepts_the_test_server() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let version: i32 = client
        .query_one("SELECT current_setting('server_version_num')::int", &[])
        .await
        .unwrap()
        .get(0);
    pgbus::schema::check_server_version(version).unwrap();
    client
        .batch_execute("DROP SCHEMA pgbus CASCADE")
        .await
        .unwrap();
    let applied = pgbus::migrate(&client).await.unwrap();
    assert_eq!(applied.len(), pgbus::schema::MIGRATIONS.len());
    if let Some(major) = std::env::var("PGBUS_TEST_SERVER_MAJOR")
        .ok()
        .filter(|m| !m.is_empty())
    {
        let major: i32 = major.parse().expect("PGBUS_TEST_SERVER_MAJOR is a number");
        assert_eq!(version / 10_000, major, "server_version_num {version}");
    }
}

/// `sql/schema.sql` is the fully migrated schema as the catalogs describe it, so that a
/// review of a migration shows what it changed and "what does `pgbus.fan_out` do now" has
/// one answer in the tree. A migration that changes the schema rewrites it in the same
/// commit: `scripts/schema-sql`.
#[tokio::test]
async fn sql_schema_sql_is_the_migrated_schema() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let rendered = common::schema_sql(&client).await.unwrap();
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("sql/schema.sql");
    if std::env::var_os("PGBUS_WRITE_SCHEMA_SQL").is_some() {
        std::fs::write(&path, &rendered).unwrap();
        return;
    }
    let stored = std::fs::read_to_string(&path).unwrap_or_default();
    if let Some((n, (want, got))) = stored
        .lines()
        .chain(std::iter::repeat(""))
        .zip(rendered.lines().chain(std::iter::repeat("")))
        .take(stored.lines().count().max(rendered.lines().count()))
        .enumerate()
        .find(|(_, (a, b))| a != b)
    {
        panic!(
            "sql/schema.sql is not the migrated schema (run scripts/schema-sql); line {}:\n  \
             stored:   {want}\n  migrated: {got}",
            n + 1
        );
    }
}

/// The rendering sees what a migration would change: an index, a column default and a
/// function's body each change the text.
#[tokio::test]
async fn the_schema_text_changes_with_the_schema() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let before = common::schema_sql(&client).await.unwrap();
    assert!(
        before.contains("CREATE OR REPLACE FUNCTION pgbus.fan_out_committed()"),
        "no fan_out_committed in:\n{before}"
    );
    client
        .batch_execute(
            "CREATE INDEX schema_text_probe ON pgbus.events (source); \
             ALTER TABLE pgbus.events ALTER COLUMN source SET DEFAULT 'probe'; \
             CREATE FUNCTION pgbus.schema_text_probe() RETURNS int LANGUAGE sql AS 'SELECT 1'",
        )
        .await
        .unwrap();
    let after = common::schema_sql(&client).await.unwrap();
    for needle in [
        "CREATE INDEX schema_text_probe ON pgbus.events USING btree (source)",
        "source text DEFAULT 'probe'::text",
        "CREATE OR REPLACE FUNCTION pgbus.schema_text_probe()",
        "-- No pinned search_path: it runs on its caller's, so every name in it must be\n\
         -- schema-qualified (sql/0012_pinned_paths.sql; tests/hostile_neighbour.rs keeps the list).\n\
         CREATE OR REPLACE FUNCTION pgbus.schema_text_probe()",
    ] {
        assert!(!before.contains(needle), "{needle} was there before");
        assert!(after.contains(needle), "{needle} missing from:\n{after}");
    }
}
