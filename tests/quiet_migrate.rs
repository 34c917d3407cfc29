//! `migrate` logs what it applied, not the server's notices: on a database it migrates
//! from scratch, one line per migration; run again, nothing at INFO and no NOTICE line,
//! through tokio-postgres and through sqlx (whose drivers log each notice at INFO).
//!
//! The migrations themselves raise no notice today: an event trigger of the test's own
//! raises one on every DDL command, as a migration that drops something `IF EXISTS`
//! would, and a probe checks that a notice outside `migrate` is logged.

mod common;
#[path = "shared/logs.rs"]
mod logs;

use logs::LogBuffer;

/// The lines that carry a server's notice: tokio-postgres logs `NOTICE: <message>`
/// (through `log`), sqlx under the target `sqlx::postgres::notice`.
fn notices(lines: &[String]) -> Vec<&String> {
    lines
        .iter()
        .filter(|l| l.contains("NOTICE") || l.contains("postgres::notice"))
        .collect()
}

/// Drops the schema the template had, and makes every DDL command raise a notice.
async fn from_scratch_with_noisy_ddl(client: &tokio_postgres::Client) {
    client
        .batch_execute(
            "DROP SCHEMA pgbus CASCADE;
             CREATE FUNCTION public.notice_on_ddl() RETURNS event_trigger LANGUAGE plpgsql
                 AS $$ BEGIN RAISE NOTICE 'ddl command: %', tg_tag; END $$;
             CREATE EVENT TRIGGER notice_on_ddl ON ddl_command_end
                 EXECUTE FUNCTION public.notice_on_ddl()",
        )
        .await
        .unwrap();
}

/// A statement that raises a notice outside `migrate`: its driver logs it.
const PROBE: &str = "DO $$ BEGIN RAISE NOTICE 'probe notice'; END $$";

/// The lines that say a migration was applied.
fn applied(lines: &[String]) -> Vec<&String> {
    lines
        .iter()
        .filter(|l| l.contains("applied migration"))
        .collect()
}

// One test: the subscriber (and the bridge from `log`, which tokio-postgres logs
// through) is the process's.
#[tokio::test]
async fn migrate_logs_the_migrations_it_applied_and_no_server_notice() {
    let logs = LogBuffer::default();
    let writer = logs.clone();
    // Every target at DEBUG: the drivers' notices are at INFO, `migrate`'s up-to-date
    // line at DEBUG.
    tracing_subscriber::fmt()
        .with_env_filter("debug")
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .init();
    let count = pgbus::schema::MIGRATIONS.len();

    let db = common::test_db().await;
    let client = db.connect().await;
    from_scratch_with_noisy_ddl(&client).await;
    logs.take();
    assert_eq!(pgbus::migrate(&client).await.unwrap().len(), count);
    let first = logs.take();
    assert_eq!(applied(&first).len(), count, "{first:#?}");
    assert!(notices(&first).is_empty(), "{:#?}", notices(&first));

    assert!(pgbus::migrate(&client).await.unwrap().is_empty());
    let second = logs.take();
    assert!(notices(&second).is_empty(), "{:#?}", notices(&second));
    assert!(applied(&second).is_empty(), "{second:#?}");
    assert_eq!(
        second
            .iter()
            .filter(|l| l.contains("pgbus schema is up to date"))
            .count(),
        1,
        "{second:#?}"
    );
    assert!(
        !second.iter().any(|l| l.contains(" INFO ")),
        "nothing at INFO when nothing is applied: {second:#?}"
    );
    client.batch_execute(PROBE).await.unwrap();
    let probe = logs.take();
    assert!(
        notices(&probe).iter().any(|l| l.contains("probe notice")),
        "the driver logs a notice outside migrate: {probe:#?}"
    );

    #[cfg(feature = "sqlx")]
    {
        let db = common::test_db().await;
        from_scratch_with_noisy_ddl(&db.connect().await).await;
        let pool = sqlx::PgPool::connect(&db.url()).await.unwrap();
        logs.take();
        assert_eq!(pgbus::sqlx::migrate(&pool).await.unwrap().len(), count);
        let first = logs.take();
        assert_eq!(applied(&first).len(), count, "{first:#?}");
        assert!(notices(&first).is_empty(), "{:#?}", notices(&first));

        assert!(pgbus::sqlx::migrate(&pool).await.unwrap().is_empty());
        let second = logs.take();
        assert!(notices(&second).is_empty(), "{:#?}", notices(&second));
        assert!(applied(&second).is_empty(), "{second:#?}");
        assert!(
            !second.iter().any(|l| l.contains(" INFO ")),
            "nothing at INFO when nothing is applied: {second:#?}"
        );
        sqlx::raw_sql(PROBE).execute(&pool).await.unwrap();
        let probe = logs.take();
        assert!(
            notices(&probe).iter().any(|l| l.contains("probe notice")),
            "sqlx logs a notice outside migrate: {probe:#?}"
        );
    }
}
