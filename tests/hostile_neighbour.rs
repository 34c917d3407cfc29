//! A hostile neighbour: a role with nothing more than CREATE on the database (and on
//! `public`, as before PostgreSQL 15) tries to get its code run by a superuser or by
//! pgbus's roles.
//!
//! - `migrate` refuses a `pgbus` schema, or objects in it, that another role made
//!   (`Error::UnsafeSchema`), writes nothing, and runs nothing of theirs.
//! - An advisory lock on a fixed key, which any role that can connect may hold, no
//!   longer stalls `migrate`.
//! - Look-alike operators, functions, types and relations planted in `public` and in
//!   schemas named after the victims (`"$user"`) never run through any pgbus path: every
//!   function of pgbus pins its search_path or is immune, and `migrate`'s and the bus's
//!   own transactions run with the pinned path.

mod common;
#[path = "shared/roles.rs"]
mod roles;

use roles::Roles;

use std::time::Duration;

use futures::{SinkExt, StreamExt};
use pgbus::admin::{self, DeadLetterFilter, SubscriptionChange};
use pgbus::{Bus, Error, Event};
use serde_json::json;
use tokio_postgres::{Client, Config, NoTls};

const WAIT: Duration = Duration::from_secs(60);

async fn connect(config: &Config) -> Client {
    let (client, connection) = config.connect(NoTls).await.unwrap();
    tokio::spawn(async move {
        let _ = connection.await;
    });
    client
}

fn as_role(config: &Config, role: &str) -> Config {
    let mut config = config.clone();
    config.user(role);
    config
}

async fn is_superuser(admin: &Client, role: &str) -> bool {
    admin
        .query_one(
            "SELECT rolsuper FROM pg_catalog.pg_roles WHERE rolname = $1",
            &[&role],
        )
        .await
        .unwrap()
        .get(0)
}

/// Every object in schema `pgbus` (and the schema's owner), to show that nothing was
/// written.
async fn objects(admin: &Client) -> Vec<String> {
    admin
        .query(
            "SELECT 'schema ' || pg_catalog.pg_get_userbyid(n.nspowner)
             FROM pg_catalog.pg_namespace AS n WHERE n.nspname = 'pgbus'
             UNION ALL
             SELECT c.relkind::text || ' ' || c.relname || ' ' || pg_catalog.pg_get_userbyid(c.relowner)
             FROM pg_catalog.pg_class AS c JOIN pg_catalog.pg_namespace AS n
               ON n.oid = c.relnamespace WHERE n.nspname = 'pgbus'
             UNION ALL
             SELECT 'function ' || p.proname FROM pg_catalog.pg_proc AS p
             JOIN pg_catalog.pg_namespace AS n ON n.oid = p.pronamespace WHERE n.nspname = 'pgbus'
             UNION ALL
             SELECT 'trigger ' || t.tgname FROM pg_catalog.pg_trigger AS t
             JOIN pg_catalog.pg_class AS c ON c.oid = t.tgrelid
             JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace
             WHERE n.nspname = 'pgbus' AND NOT t.tgisinternal
             ORDER BY 1",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// A trigger function that makes `role` a superuser when it runs with a superuser's
/// rights (and does nothing otherwise), in schema `schema`.
fn escalating_function(schema: &str, role: &str) -> String {
    format!(
        "CREATE FUNCTION {schema}.escalate() RETURNS trigger LANGUAGE plpgsql AS $f$
         BEGIN
             BEGIN
                 EXECUTE 'ALTER ROLE {role} SUPERUSER';
             EXCEPTION WHEN insufficient_privilege THEN NULL;
             END;
             RETURN NULL;
         END $f$;"
    )
}

/// The trap of the issue: a low role with CREATE on the database creates the schema and
/// the migrations' table first, with a trigger that makes it a superuser. `migrate` as
/// the superuser refuses, names each object and the fix, writes nothing, runs nothing;
/// once the schema is dropped, `migrate` works.
#[tokio::test]
async fn migrate_refuses_a_schema_a_low_role_created_first() {
    let db = common::test_db().await;
    let admin = db.connect().await;
    admin
        .batch_execute("DROP SCHEMA pgbus CASCADE")
        .await
        .unwrap();
    let roles = Roles::create(db.config(), &["low"]).await;
    let low = &roles.names[0];
    admin
        .batch_execute(&format!("GRANT CREATE ON DATABASE {} TO {low}", db.name()))
        .await
        .unwrap();
    let lc = connect(&as_role(&db.config(), low)).await;
    lc.batch_execute(&format!(
        "CREATE SCHEMA pgbus;
         CREATE TABLE pgbus.schema_migrations (
             version integer PRIMARY KEY, name text NOT NULL, checksum text NOT NULL,
             applied_at timestamptz NOT NULL DEFAULT now());
         {}
         CREATE TRIGGER on_row BEFORE INSERT OR UPDATE OR DELETE ON pgbus.schema_migrations
             FOR EACH ROW EXECUTE FUNCTION pgbus.escalate();
         CREATE TRIGGER on_statement AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE
             ON pgbus.schema_migrations FOR EACH STATEMENT EXECUTE FUNCTION pgbus.escalate();
         GRANT ALL ON SCHEMA pgbus TO PUBLIC;
         GRANT ALL ON pgbus.schema_migrations TO PUBLIC;",
        escalating_function("pgbus", low)
    ))
    .await
    .unwrap();
    let before = objects(&admin).await;

    let err = pgbus::migrate(&admin).await.unwrap_err();
    let Error::UnsafeSchema { role, problems } = &err else {
        panic!("expected UnsafeSchema, got {err:?}");
    };
    let me: String = admin
        .query_one("SELECT current_user::text", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(role, &me);
    for expected in [
        format!("schema pgbus is owned by {low}"),
        format!("table pgbus.schema_migrations is owned by {low}"),
        format!("function pgbus.escalate() is owned by {low}"),
        format!("trigger on_row on pgbus.schema_migrations runs pgbus.escalate(), owned by {low}"),
        "CREATE on schema pgbus is granted to PUBLIC".to_owned(),
        "TRIGGER on pgbus.schema_migrations is granted to PUBLIC".to_owned(),
    ] {
        assert!(
            problems.contains(&expected),
            "{expected:?} not in {problems:?}"
        );
    }
    let message = err.to_string();
    assert!(message.contains("DROP SCHEMA pgbus CASCADE"), "{message}");
    assert!(message.contains(&format!("OWNER TO {me}")), "{message}");
    assert!(message.contains(low.as_str()), "{message}");

    assert!(
        !is_superuser(&admin, low).await,
        "the low role became a superuser"
    );
    assert_eq!(objects(&admin).await, before, "migrate wrote something");
    let rows: i64 = admin
        .query_one("SELECT count(*) FROM pgbus.schema_migrations", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(rows, 0);

    // The fix the message names.
    admin
        .batch_execute("DROP SCHEMA pgbus CASCADE")
        .await
        .unwrap();
    let applied = pgbus::migrate(&admin).await.unwrap();
    assert_eq!(applied.len(), pgbus::schema::MIGRATIONS.len());
    assert!(!is_superuser(&admin, low).await);
    drop(lc);
}

/// The same refusal through `pgbus::sqlx::migrate`.
#[cfg(feature = "sqlx")]
#[tokio::test]
async fn sqlx_migrate_refuses_a_schema_a_low_role_created_first() {
    use sqlx::Connection as _;
    use sqlx::postgres::{PgConnectOptions, PgConnection, PgSslMode};
    use tokio_postgres::config::Host;

    let db = common::test_db().await;
    let admin = db.connect().await;
    admin
        .batch_execute("DROP SCHEMA pgbus CASCADE")
        .await
        .unwrap();
    let roles = Roles::create(db.config(), &["low"]).await;
    let low = &roles.names[0];
    admin
        .batch_execute(&format!("GRANT CREATE ON DATABASE {} TO {low}", db.name()))
        .await
        .unwrap();
    let lc = connect(&as_role(&db.config(), low)).await;
    lc.batch_execute(&format!(
        "CREATE SCHEMA pgbus;
         CREATE TABLE pgbus.schema_migrations (version integer PRIMARY KEY, name text,
             checksum text, applied_at timestamptz DEFAULT now());
         {}
         CREATE TRIGGER on_row BEFORE INSERT ON pgbus.schema_migrations
             FOR EACH ROW EXECUTE FUNCTION pgbus.escalate();",
        escalating_function("pgbus", low)
    ))
    .await
    .unwrap();
    let before = objects(&admin).await;
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
    let mut conn = PgConnection::connect_with(&options.database(db.name()))
        .await
        .unwrap();
    let err = pgbus::sqlx::migrate(&mut conn).await.unwrap_err();
    let Error::UnsafeSchema { problems, .. } = &err else {
        panic!("expected UnsafeSchema, got {err:?}");
    };
    assert!(
        problems.contains(&format!("schema pgbus is owned by {low}")),
        "{problems:?}"
    );
    assert!(!is_superuser(&admin, low).await);
    assert_eq!(objects(&admin).await, before);
}

/// Objects planted in a schema that pgbus's owner made: through a CREATE on the schema
/// granted by mistake, through a TRIGGER privilege on one of its tables, through an
/// object given away. Each is refused, nothing runs, nothing is written.
#[tokio::test]
async fn migrate_refuses_objects_planted_in_the_owners_schema() {
    let db = common::test_db().await;
    let admin = db.connect().await;
    let roles = Roles::create(db.config(), &["low"]).await;
    let low = roles.names[0].clone();
    admin
        .batch_execute(&format!(
            "GRANT CREATE ON DATABASE {} TO {low};
             GRANT USAGE ON SCHEMA pgbus TO {low};",
            db.name()
        ))
        .await
        .unwrap();
    let lc = connect(&as_role(&db.config(), &low)).await;
    lc.batch_execute(&format!(
        "CREATE SCHEMA {low};
         {}",
        escalating_function(&low, &low)
    ))
    .await
    .unwrap();
    // A migration that is not applied yet, so that migrate has something to write.
    admin
        .execute(
            "DELETE FROM pgbus.schema_migrations WHERE version = $1",
            &[&pgbus::schema::latest_version()],
        )
        .await
        .unwrap();
    let recorded = pgbus::schema::schema_version(&admin).await.unwrap();

    type Plant = (&'static str, &'static str, &'static str);
    let plants: [Plant; 3] = [
        (
            // A CREATE granted on the schema: a table of the low role's, with a trigger.
            "GRANT CREATE ON SCHEMA pgbus TO {low}",
            "CREATE TABLE pgbus.planted (x int);
             CREATE TRIGGER t AFTER INSERT ON pgbus.planted
                 FOR EACH STATEMENT EXECUTE FUNCTION {low}.escalate();",
            "table pgbus.planted is owned by {low}",
        ),
        (
            // A TRIGGER privilege on the migrations' table: a trigger with its function.
            "GRANT TRIGGER ON pgbus.schema_migrations TO {low}",
            "CREATE TRIGGER t BEFORE INSERT ON pgbus.schema_migrations
                 FOR EACH ROW EXECUTE FUNCTION {low}.escalate();",
            "trigger t on pgbus.schema_migrations runs {low}.escalate(), owned by {low}",
        ),
        (
            // A table given away.
            "ALTER TABLE pgbus.settings OWNER TO {low}",
            "CREATE TRIGGER t BEFORE UPDATE ON pgbus.settings
                 FOR EACH STATEMENT EXECUTE FUNCTION {low}.escalate();",
            "table pgbus.settings is owned by {low}",
        ),
    ];
    for (grant, plant, expected) in plants {
        let (grant, plant, expected) = (
            grant.replace("{low}", &low),
            plant.replace("{low}", &low),
            expected.replace("{low}", &low),
        );
        admin.batch_execute(&grant).await.unwrap();
        lc.batch_execute(&plant).await.unwrap();
        let before = objects(&admin).await;
        let err = pgbus::migrate(&admin).await.unwrap_err();
        let Error::UnsafeSchema { problems, .. } = &err else {
            panic!("{grant}: expected UnsafeSchema, got {err:?}");
        };
        assert!(
            problems.contains(&expected),
            "{expected:?} not in {problems:?}"
        );
        assert!(!is_superuser(&admin, &low).await, "{grant}: escalated");
        assert_eq!(
            objects(&admin).await,
            before,
            "{grant}: migrate wrote something"
        );
        let version: Option<i32> = pgbus::schema::schema_version(&admin).await.unwrap();
        assert_eq!(version, recorded, "{grant}");
        // Undo it for the next variant.
        admin
            .batch_execute(&format!(
                "DROP TABLE IF EXISTS pgbus.planted;
                 DROP TRIGGER IF EXISTS t ON pgbus.schema_migrations;
                 DROP TRIGGER IF EXISTS t ON pgbus.settings;
                 ALTER TABLE pgbus.settings OWNER TO current_user;
                 REVOKE CREATE ON SCHEMA pgbus FROM {low};
                 REVOKE TRIGGER ON pgbus.schema_migrations FROM {low};"
            ))
            .await
            .unwrap();
    }
    // Clean again, migrate applies what was missing.
    let applied = pgbus::migrate(&admin).await.unwrap();
    assert_eq!(
        applied.iter().map(|m| m.version).collect::<Vec<_>>(),
        [pgbus::schema::latest_version()]
    );
    assert!(!is_superuser(&admin, &low).await);
}

/// The advisory lock on the fixed key that serialized migrations could be held by any
/// role that can connect, and `migrate` waited for it forever. The lock is now one on
/// pgbus's own table: a role holding the old key changes nothing.
#[tokio::test]
async fn a_role_holding_the_old_migration_lock_cannot_stall_migrate() {
    let db = common::test_db().await;
    let admin = db.connect().await;
    let roles = Roles::create(db.config(), &["nobody"]).await;
    let nobody = connect(&as_role(&db.config(), &roles.names[0])).await;
    // The old key, "pgbus_mg", and the configuration and wake keys for good measure.
    nobody
        .batch_execute(
            "SELECT pg_advisory_lock(8099550711435455847);
             SELECT pg_advisory_lock_shared(8099550711435453286);
             SELECT pg_advisory_lock_shared(8099550711435458411);",
        )
        .await
        .unwrap();
    let held: i64 = admin
        .query_one(
            "SELECT count(*) FROM pg_catalog.pg_locks WHERE locktype = 'advisory' AND granted",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(held, 3);

    // Already current, and from scratch.
    let again = common::within("migrate of a current schema", WAIT, pgbus::migrate(&admin))
        .await
        .unwrap();
    assert!(again.is_empty());
    admin
        .batch_execute("DROP SCHEMA pgbus CASCADE")
        .await
        .unwrap();
    let applied = common::within("migrate from scratch", WAIT, pgbus::migrate(&admin))
        .await
        .unwrap();
    assert_eq!(applied.len(), pgbus::schema::MIGRATIONS.len());
    drop(nobody);
}

/// Every function in schema pgbus runs with the pinned search_path, or is one of the
/// few immune ones migration 12 names (inlined SQL functions and per-row helpers, whose
/// every name is qualified).
#[tokio::test]
async fn every_function_pins_its_search_path_or_is_immune() {
    const IMMUNE: &[&str] = &[
        "event_key",
        "lock_config",
        "lock_keys",
        "name_keys",
        "next_of_key",
        "pattern_matches",
        "require_read_committed",
        "subscriptions_matching",
        "uuid_v7",
    ];
    let db = common::test_db().await;
    let client = db.connect().await;
    let rows = client
        .query(
            "SELECT p.proname::text, p.oid::regprocedure::text, coalesce(p.proconfig, '{}')
             FROM pg_catalog.pg_proc AS p JOIN pg_catalog.pg_namespace AS n ON n.oid = p.pronamespace
             WHERE n.nspname = 'pgbus' ORDER BY 2",
            &[],
        )
        .await
        .unwrap();
    assert!(rows.len() > 30, "{}", rows.len());
    let mut unpinned = Vec::new();
    for row in &rows {
        let name: String = row.get(0);
        let signature: String = row.get(1);
        let config: Vec<String> = row.get(2);
        let path = config.iter().find_map(|c| c.strip_prefix("search_path="));
        match path {
            Some(path) => {
                let parts: Vec<&str> = path
                    .split(',')
                    .map(|p| p.trim().trim_matches('"'))
                    .collect();
                assert_eq!(
                    parts,
                    ["pg_catalog", "pgbus", "pg_temp"],
                    "{signature} runs with search_path {path}"
                );
            }
            None if IMMUNE.contains(&name.as_str()) => {}
            None => unpinned.push(signature),
        }
    }
    assert!(
        unpinned.is_empty(),
        "functions without a pinned search_path: {unpinned:?}"
    );
}

/// The SQL pgbus runs: its functions' bodies and the library's statements. Planted
/// look-alikes are generated for the operator and function names found here.
async fn pgbus_sql(admin: &Client) -> String {
    let bodies: String = admin
        .query_one(
            "SELECT pg_catalog.string_agg(p.prosrc, ' ') FROM pg_catalog.pg_proc AS p
             JOIN pg_catalog.pg_namespace AS n ON n.oid = p.pronamespace WHERE n.nspname = 'pgbus'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    // Every statement the library sends is in src/sql/ (tests/sql_home.rs keeps it so):
    // every file of it, so that a new one is in the corpus too.
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/sql");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    assert!(files.len() > 5, "src/sql/ was not read: {files:?}");
    files.iter().fold(bodies, |corpus, file| {
        corpus + " " + &std::fs::read_to_string(file).unwrap()
    })
}

/// Plants, in each of `schemas`, look-alikes that record that they ran (a sequence,
/// which no rollback undoes, and a row of the recording table) and then do what the
/// real one does:
/// - for every binary operator name of pg_catalog found in the corpus, and every pair of
///   common types for which pg_catalog has no exact operator but resolves one through a
///   cast, an exact-match operator (`*(bigint, interval)`, `<=(numeric, bigint)`, ...);
/// - for every function name of pg_catalog found in the corpus (called `name(`), the
///   same for one and two arguments of those types, and the no-argument form where
///   pg_catalog has one (`now()`);
/// - domains named after the common types, whose CHECK records;
/// - views named after pgbus's tables, whose rows record.
///
/// Runs as the low role, which owns schema `own` (the recorder). The corpus is bound
/// as `$names$...$names$` in place of `NAMES`.
fn plant_sql(own: &str, schemas: &[String]) -> String {
    let mut out = format!(
        r#"SET search_path = pg_catalog;
         CREATE SEQUENCE {own}.hits;
         CREATE TABLE {own}.ran (what text);
         GRANT USAGE ON SCHEMA {own} TO PUBLIC;
         GRANT USAGE, SELECT, UPDATE ON SEQUENCE {own}.hits TO PUBLIC;
         GRANT INSERT, SELECT ON {own}.ran TO PUBLIC;
         CREATE FUNCTION {own}.hit(what text) RETURNS boolean LANGUAGE plpgsql
         SET search_path = pg_catalog AS $f$
         BEGIN
             PERFORM pg_catalog.nextval('{own}.hits'::pg_catalog.regclass);
             INSERT INTO {own}.ran VALUES (what || ' as ' || current_user);
             RETURN true;
         END $f$;
         CREATE TABLE {own}.candidates (kind text, name text, a text, b text, r text);
         DO $g$
         DECLARE
             names text := $names$NAMES$names$;
             v_types text[] := ARRAY['int2', 'int4', 'int8', 'numeric', 'float8', 'text', 'name',
                                     'interval', 'timestamptz', 'jsonb', 'bool', 'xid', 'text[]',
                                     'uuid', 'bytea', 'oid'];
             v_op text; v_fn text; v_a text; v_b text; v_r regtype;
         BEGIN
             FOR v_op IN
                 SELECT DISTINCT o.oprname::text FROM pg_operator AS o
                 WHERE o.oprnamespace = 'pg_catalog'::regnamespace AND o.oprkind = 'b'
                   AND strpos(names, ' ' || o.oprname || ' ') > 0
             LOOP
                 FOREACH v_a IN ARRAY v_types LOOP
                     FOREACH v_b IN ARRAY v_types LOOP
                         CONTINUE WHEN EXISTS (
                             SELECT FROM pg_operator AS o
                             WHERE o.oprnamespace = 'pg_catalog'::regnamespace AND o.oprname = v_op
                               AND o.oprleft = v_a::regtype AND o.oprright = v_b::regtype);
                         BEGIN
                             EXECUTE format('SELECT pg_typeof(NULL::%s OPERATOR(pg_catalog.%s) NULL::%s)',
                                            v_a, v_op, v_b) INTO v_r;
                         EXCEPTION WHEN OTHERS THEN
                             CONTINUE;
                         END;
                         INSERT INTO {own}.candidates VALUES ('operator', v_op, v_a, v_b, v_r::text);
                     END LOOP;
                 END LOOP;
             END LOOP;
             FOR v_fn IN
                 SELECT DISTINCT p.proname::text FROM pg_proc AS p
                 WHERE p.pronamespace = 'pg_catalog'::regnamespace AND p.prokind = 'f'
                   AND NOT p.proretset AND p.pronargs <= 2
                   AND names ~ ('[^a-z_.]' || p.proname || '\s*\(')
             LOOP
                 BEGIN
                     EXECUTE format('SELECT pg_typeof(pg_catalog.%I())', v_fn) INTO v_r;
                     INSERT INTO {own}.candidates VALUES ('function', v_fn, NULL, NULL, v_r::text);
                 EXCEPTION WHEN OTHERS THEN
                     NULL;
                 END;
                 FOREACH v_a IN ARRAY v_types LOOP
                     FOREACH v_b IN ARRAY array_prepend(NULL, v_types) LOOP
                         CONTINUE WHEN EXISTS (
                             SELECT FROM pg_proc AS p
                             WHERE p.pronamespace = 'pg_catalog'::regnamespace AND p.proname = v_fn
                               AND p.proargtypes::oid[] = CASE WHEN v_b IS NULL THEN ARRAY[v_a::regtype::oid]
                                                               ELSE ARRAY[v_a::regtype::oid, v_b::regtype::oid] END);
                         BEGIN
                             IF v_b IS NULL THEN
                                 EXECUTE format('SELECT pg_typeof(pg_catalog.%I(NULL::%s))', v_fn, v_a) INTO v_r;
                             ELSE
                                 EXECUTE format('SELECT pg_typeof(pg_catalog.%I(NULL::%s, NULL::%s))',
                                                v_fn, v_a, v_b) INTO v_r;
                             END IF;
                         EXCEPTION WHEN OTHERS THEN
                             CONTINUE;
                         END;
                         CONTINUE WHEN v_r::text IN ('anyelement', 'anyarray', 'void', 'record',
                                                     'trigger', 'unknown', 'anynonarray');
                         INSERT INTO {own}.candidates VALUES ('function', v_fn, v_a, v_b, v_r::text);
                     END LOOP;
                 END LOOP;
             END LOOP;
         END $g$;
         CREATE FUNCTION {own}.plant(target text) RETURNS integer LANGUAGE plpgsql
         SET search_path = pg_catalog AS $g$
         DECLARE
             c record; v_n integer := 0; v_plant text; v_label text; v_a text;
         BEGIN
             FOR c IN SELECT * FROM {own}.candidates LOOP
                 v_n := v_n + 1;
                 v_label := format('%s %s.%s(%s)', c.kind, target, c.name, concat_ws(', ', c.a, c.b));
                 IF c.kind = 'operator' THEN
                     v_plant := format('planted_%s', v_n);
                     EXECUTE format(
                         'CREATE FUNCTION %s.%I(%s, %s) RETURNS %s LANGUAGE plpgsql
                          SET search_path = pg_catalog AS $b$
                          BEGIN PERFORM {own}.hit(%L); RETURN $1 OPERATOR(pg_catalog.%s) $2; END $b$',
                         target, v_plant, c.a, c.b, c.r, v_label, c.name);
                     EXECUTE format('CREATE OPERATOR %s.%s (FUNCTION = %s.%I, LEFTARG = %s, RIGHTARG = %s)',
                                    target, c.name, target, v_plant, c.a, c.b);
                 ELSE
                     BEGIN
                         EXECUTE format(
                             'CREATE FUNCTION %s.%I(%s) RETURNS %s LANGUAGE plpgsql VOLATILE
                              SET search_path = pg_catalog AS $b$
                              BEGIN PERFORM {own}.hit(%L); RETURN pg_catalog.%I(%s); END $b$',
                             target, c.name, concat_ws(', ', c.a, c.b), c.r, v_label, c.name,
                             CASE WHEN c.b IS NOT NULL THEN '$1, $2' WHEN c.a IS NOT NULL THEN '$1' ELSE '' END);
                     EXCEPTION WHEN OTHERS THEN
                         v_n := v_n - 1;
                     END;
                 END IF;
             END LOOP;
             FOREACH v_a IN ARRAY ARRAY['text', 'int2', 'int4', 'int8', 'numeric', 'float8', 'name',
                                        'timestamptz', 'jsonb', 'bool', 'uuid', 'bytea', 'regclass',
                                        'regrole', 'regprocedure'] LOOP
                 EXECUTE format('CREATE DOMAIN %s.%I AS pg_catalog.%I CHECK ({own}.hit(%L))',
                                target, v_a, v_a, format('domain %s.%s', target, v_a));
                 v_n := v_n + 1;
             END LOOP;
             FOREACH v_a IN ARRAY ARRAY['events', 'subscriptions', 'subscription_patterns',
                                        'deliveries', 'delivery_failures', 'consumers', 'settings',
                                        'schema_migrations', 'key_pos_seq'] LOOP
                 EXECUTE format('CREATE VIEW %s.%I AS SELECT {own}.hit(%L) AS planted',
                                target, v_a, format('view %s.%s', target, v_a));
                 v_n := v_n + 1;
             END LOOP;
             RETURN v_n;
         END $g$;"#
    );
    for schema in schemas {
        out.push_str(&format!(
            "\nGRANT USAGE ON SCHEMA {schema} TO PUBLIC;\nSELECT {own}.plant($t${schema}$t$);"
        ));
    }
    out
}

/// How many times a planted object ran (read on a connection with the pinned path).
async fn hits(check: &Client, own: &str) -> (i64, Vec<String>) {
    let n: i64 = check
        .query_one(
            &format!("SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM {own}.hits"),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let ran: Vec<String> = check
        .query(&format!("SELECT what FROM {own}.ran ORDER BY 1"), &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    (n, ran)
}

/// The escalation of the issue: exact-match look-alikes of what pgbus's SQL calls,
/// planted in `public` (writable, as before PostgreSQL 15) and in schemas named after
/// the superuser, a publisher and a consumer (`"$user"`, first on their default paths).
/// Then every pgbus path runs as them: publishing every way, a bus consuming (ack, ack
/// in a transaction, failure, retry, dead letter), the operator functions, and migrate
/// from scratch. Nothing planted runs. The negative control unpins one function and
/// sees a plant run, so the test can fail.
#[tokio::test]
async fn nothing_planted_in_public_or_a_user_schema_ever_runs() {
    let db = common::test_db().await;
    let admin = db.connect().await;
    let me: String = admin
        .query_one("SELECT current_user::text", &[])
        .await
        .unwrap()
        .get(0);
    let roles = Roles::create(db.config(), &["low", "publisher", "consumer"]).await;
    let (low, publisher, consumer) = (&roles.names[0], &roles.names[1], &roles.names[2]);
    admin
        .batch_execute(&format!(
            "GRANT CREATE ON DATABASE {db} TO {low};
             GRANT CREATE ON SCHEMA public TO PUBLIC;
             SELECT pgbus.grant_publisher('{publisher}');
             SELECT pgbus.grant_consumer('{consumer}');
             INSERT INTO pgbus.subscriptions (name, patterns, max_attempts, ordered, on_dead)
             VALUES ('plain', '{{hn.*}}', 2, false, 'block'), ('keyed', '{{hn.*}}', 1, true, 'skip');",
            db = db.name()
        ))
        .await
        .unwrap();
    let lc = connect(&as_role(&db.config(), low)).await;
    lc.batch_execute(&format!("CREATE SCHEMA {low}"))
        .await
        .unwrap();
    let mut schemas = vec!["public".to_owned()];
    for victim in [&me, publisher, consumer] {
        let exists: bool = admin
            .query_one(
                "SELECT EXISTS (SELECT FROM pg_catalog.pg_namespace WHERE nspname = $1)",
                &[victim],
            )
            .await
            .unwrap()
            .get(0);
        if !exists {
            lc.batch_execute(&format!("CREATE SCHEMA \"{victim}\""))
                .await
                .unwrap();
            schemas.push(format!("\"{victim}\""));
        }
    }
    // The operator and function names of pgbus's SQL, and its operators as words.
    let names = pgbus_sql(&admin).await;
    let words: String = names
        .chars()
        .map(|c| {
            if c.is_alphanumeric() || c == '_' || c.is_whitespace() {
                c
            } else {
                ' '
            }
        })
        .collect();
    let operators: Vec<&str> = names
        .split(|c: char| {
            c.is_alphanumeric() || c == '_' || c.is_whitespace() || "()[],;'\"$.:{}".contains(c)
        })
        .filter(|t| !t.is_empty())
        .collect();
    let corpus = format!(" {} {} {names} ", operators.join(" "), words).replace("$names$", "");
    let planted = plant_sql(low, &schemas).replace("NAMES", &corpus);
    common::within(
        "planting",
        Duration::from_secs(600),
        lc.batch_execute(&planted),
    )
    .await
    .unwrap();
    let check = db.connect().await;
    check
        .batch_execute("SET search_path = pg_catalog")
        .await
        .unwrap();
    let count: i64 = check
        .query_one(
            "SELECT (SELECT count(*) FROM pg_catalog.pg_operator AS o
                     JOIN pg_catalog.pg_namespace AS n ON n.oid = o.oprnamespace
                     WHERE n.nspname <> 'pg_catalog' AND n.nspname <> 'pgbus')
                  + (SELECT count(*) FROM pg_catalog.pg_proc AS p
                     JOIN pg_catalog.pg_namespace AS n ON n.oid = p.pronamespace
                     WHERE n.nspname = 'public')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(count > 200, "only {count} plants");
    assert_eq!(hits(&check, low).await.0, 0);
    // The victims have the plants on their paths.
    let probe = db.connect().await;
    let shows: String = probe
        .query_one("SELECT pg_catalog.current_schemas(false)::text", &[])
        .await
        .unwrap()
        .get(0);
    assert!(shows.contains("public"), "{shows}");

    // Publishing, as the superuser and as the publisher, every way.
    let su = db.connect().await;
    let pc = connect(&as_role(&db.config(), publisher)).await;
    let mut n = 0;
    for client in [&su, &pc] {
        n += 1;
        let event = |i: u32| {
            Event::new("hn.placed", json!({"n": i}))
                .id(format!("lib-{n}-{i}"))
                .aggregate("order", format!("{i}"))
                .header("traceparent", "x")
        };
        pgbus::publish(client, &event(1)).await.unwrap();
        pgbus::publish(client, &event(2).delay(Duration::from_millis(1)))
            .await
            .unwrap();
        // A duplicate, and a conflict.
        pgbus::publish(client, &event(1)).await.unwrap();
        let conflict = pgbus::publish(client, &event(1).header("x", "y")).await;
        assert!(
            matches!(conflict, Err(Error::Conflict { .. })),
            "{conflict:?}"
        );
        pgbus::publish_batch(
            client,
            &[
                event(3),
                event(4).delay(Duration::from_millis(2)),
                event(5).ordering_key("k"),
            ],
        )
        .await
        .unwrap();
        client
            .batch_execute(&format!(
                "SELECT pgbus.publish('hn.sql', '{{}}', '{{}}', 'sql-{n}', 'order', '1', NULL, NULL, 'k',
                                      1, now() + interval '1 millisecond');
                 INSERT INTO pgbus.events (id, event_name, payload, ordering_key)
                 VALUES ('insert-{n}', 'hn.insert', '{{\"a\": 1}}', 'k');
                 INSERT INTO pgbus.events (event_name, payload, aggregate_type, aggregate_id)
                 SELECT 'hn.select', '{{}}', 'order', g::text FROM generate_series(1, 3) AS g;"
            ))
            .await
            .unwrap();
        let sink = client
            .copy_in("COPY pgbus.events (event_name, payload, ordering_key) FROM STDIN")
            .await
            .unwrap();
        futures::pin_mut!(sink);
        sink.send(&b"hn.copy\t{}\tk\nhn.copy\t{\"b\": 2}\t\\N\n"[..])
            .await
            .unwrap();
        sink.finish().await.unwrap();
    }
    let (n_hits, ran) = hits(&check, low).await;
    assert_eq!(n_hits, 0, "planted code ran while publishing: {ran:?}");

    // Consuming, as the superuser with its default path: the bus's statements, claim,
    // ack, ack in a transaction, failure and retry, dead letters.
    let mut bus = Bus::builder(db.config())
        .poll_interval(Duration::from_millis(100))
        .build()
        .unwrap();
    let mut plain = bus.subscribe("plain", ["hn.*"]).unwrap();
    let mut keyed = bus.subscribe("keyed", ["hn.*"]).unwrap();
    let running = bus.start().await.unwrap();
    let total: i64 = check
        .query_one("SELECT count(*) FROM pgbus.events", &[])
        .await
        .unwrap()
        .get(0);
    let mut txc = db.connect().await;
    let mut i = 0;
    let mut settled = 0;
    while settled < 2 * total {
        let delivery = tokio::select! {
            d = plain.next() => d,
            d = keyed.next() => d,
            _ = tokio::time::sleep(WAIT) => panic!("no delivery within {WAIT:?} ({settled} settled of {})", 2 * total),
        }
        .unwrap();
        i += 1;
        match i % 4 {
            0 => delivery.ack().await.unwrap(),
            1 => {
                let tx = txc.transaction().await.unwrap();
                delivery.ack_in(&tx).await.unwrap();
                tx.commit().await.unwrap();
            }
            2 => delivery.dead_letter("planted?").await.unwrap(),
            _ if delivery.attempt() == 1 && delivery.subscription() == "plain" => {
                delivery
                    .fail(pgbus::HandlerError::new("once more"))
                    .await
                    .unwrap();
                continue;
            }
            _ => delivery.dead_letter("done").await.unwrap(),
        }
        settled += 1;
    }
    let (n_hits, ran) = hits(&check, low).await;
    assert_eq!(n_hits, 0, "planted code ran while consuming: {ran:?}");

    // The operator functions, as the superuser with its default path.
    let since = chrono::Utc::now() - chrono::Duration::hours(1);
    admin::replay(&su, "plain", since, None, Some("hn.*"))
        .await
        .unwrap();
    admin::retry_dead_letters(&su, &DeadLetterFilter::all().subscription("plain"))
        .await
        .unwrap();
    admin::configure_subscription(
        &su,
        "plain",
        &SubscriptionChange::new().max_attempts(3).ordered(true),
    )
    .await
    .unwrap();
    admin::purge_dead_letters(&su, &DeadLetterFilter::all())
        .await
        .unwrap();
    admin::status(&su).await.unwrap();
    admin::subscriptions(&su).await.unwrap();
    admin::backlog(&su, None).await.unwrap();
    admin::dead_letters(&su, &DeadLetterFilter::all(), 10)
        .await
        .unwrap();
    admin::consumers(&su).await.unwrap();
    admin::sweep_batch(&su, Duration::from_millis(1), 100)
        .await
        .unwrap();
    let (n_hits, ran) = hits(&check, low).await;
    assert_eq!(
        n_hits, 0,
        "planted code ran in an operator function: {ran:?}"
    );
    common::within("the bus to stop", WAIT, running.shutdown())
        .await
        .unwrap();

    // A bus of the consumer role, whose own "$user" schema holds the plants.
    let mut bus = Bus::builder(as_role(&db.config(), consumer))
        .poll_interval(Duration::from_millis(100))
        .build()
        .unwrap();
    let mut plain = bus.subscribe("plain", ["hn.*"]).unwrap();
    let running = bus.start().await.unwrap();
    for i in 0..4 {
        let event = Event::new("hn.consumer", json!({"i": i}))
            .ordering_key("c")
            .delay(Duration::from_millis(1));
        pgbus::publish(&pc, &event).await.unwrap();
    }
    let mut settled = 0;
    while settled < 4 {
        let delivery = common::within("a delivery to the consumer role", WAIT, plain.next())
            .await
            .unwrap();
        if delivery.attempt() == 1 && settled % 2 == 0 {
            delivery
                .fail(pgbus::HandlerError::new("once more"))
                .await
                .unwrap();
            continue;
        }
        delivery.ack().await.unwrap();
        settled += 1;
    }
    common::within("the consumer's bus to stop", WAIT, running.shutdown())
        .await
        .unwrap();
    let (n_hits, ran) = hits(&check, low).await;
    assert_eq!(n_hits, 0, "planted code ran as the consumer role: {ran:?}");

    // Migrate from scratch, as the superuser with its default path.
    su.batch_execute("DROP SCHEMA pgbus CASCADE").await.unwrap();
    pgbus::migrate(&su).await.unwrap();
    let (n_hits, ran) = hits(&check, low).await;
    assert_eq!(n_hits, 0, "planted code ran while migrating: {ran:?}");

    // The negative control: one function unpinned, and the plant for `bigint *
    // interval` runs as the superuser publishing with a delay.
    su.batch_execute(
        "INSERT INTO pgbus.subscriptions (name, patterns) VALUES ('again', '{hn.*}');
         ALTER FUNCTION pgbus.publish_event(text, text, integer, text, text, text, text, text,
             timestamptz, text, text, timestamptz, bigint, text) RESET search_path;",
    )
    .await
    .unwrap();
    let control = Event::new("hn.control", json!({})).delay(Duration::from_millis(5));
    pgbus::publish(&su, &control).await.unwrap();
    let (n_hits, ran) = hits(&check, low).await;
    assert!(
        n_hits > 0,
        "the negative control ran no plant: the test cannot tell"
    );
    assert!(
        ran.iter()
            .any(|r| r.contains("(int8, interval)") && r.contains(&me)),
        "{ran:?}"
    );
    drop((lc, pc, su, probe));
}
