//! What the tests of the two ways to migrate share (`tests/schema.rs`: `pgbus::migrate`;
//! `tests/sqlx.rs`: `pgbus::sqlx::migrate`).

use pgbus::schema::{MIGRATIONS, Migration};

/// Records migration 1 as applied with other content than this binary carries.
pub(crate) async fn edit_first_migration(client: &tokio_postgres::Client) {
    client
        .batch_execute("UPDATE pgbus.schema_migrations SET checksum = 'edited' WHERE version = 1")
        .await
        .unwrap();
}

/// Checks that `result` reports migration 1 as drift.
pub(crate) fn assert_first_migration_drifted(result: pgbus::Result<Vec<Migration>>) {
    let err = result.unwrap_err();
    assert!(
        matches!(err, pgbus::Error::MigrationDrift { version: 1 }),
        "{err:?}"
    );
}

/// Checks that two migrations run at once both succeeded and that, between them, they
/// applied each migration exactly once.
pub(crate) fn assert_each_applied_once(
    a: pgbus::Result<Vec<Migration>>,
    b: pgbus::Result<Vec<Migration>>,
) {
    let (a, b) = (a.unwrap(), b.unwrap());
    let mut versions: Vec<i32> = a.iter().chain(&b).map(|m| m.version).collect();
    versions.sort_unstable();
    assert_eq!(
        versions,
        MIGRATIONS.iter().map(|m| m.version).collect::<Vec<_>>(),
        "each migration applied by exactly one of them: {a:?} {b:?}"
    );
}
