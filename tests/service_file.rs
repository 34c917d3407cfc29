//! libpq's connection service file: `service=` and `PGSERVICE` take their settings from
//! `PGSERVICEFILE` or `~/.pg_service.conf`; the connection string wins over the service,
//! the service over the `PG*` variables; an unknown service is refused by name.

mod common;

use std::path::Path;
use std::time::Duration;

use pgbus::{ConnectConfig, Error};
use tokio_postgres::config::Host;

const WAIT: Duration = Duration::from_secs(30);

fn env_of(vars: Vec<(&'static str, String)>) -> impl Fn(&str) -> Option<String> {
    move |name| {
        vars.iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.clone())
    }
}

/// A service file with the section `[mine]` for the test's database.
fn write_service_file(path: &Path, pg: &tokio_postgres::Config) {
    let host = match &pg.get_hosts()[0] {
        Host::Tcp(name) => name.clone(),
        Host::Unix(dir) => dir.display().to_string(),
    };
    let mut text = format!(
        "# pgbus test\n[other]\ndbname=elsewhere\n\n[mine]\nhost={host}\nport={}\nuser={}\n\
         dbname={}\nsslmode=disable\n",
        pg.get_ports()[0],
        pg.get_user().unwrap(),
        pg.get_dbname().unwrap(),
    );
    if let Some(password) = pg.get_password() {
        text.push_str(&format!("password={}\n", String::from_utf8_lossy(password)));
    }
    text.push_str("[last]\nhost=nowhere\n");
    std::fs::write(path, text).unwrap();
}

async fn database(config: &ConnectConfig) -> String {
    let client = common::within("connecting through a service", WAIT, config.connect())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    client
        .query_one("SELECT current_database()", &[])
        .await
        .unwrap()
        .get(0)
}

#[tokio::test]
async fn a_service_gives_the_settings_the_string_leaves_out() {
    let db = common::test_db().await;
    let pg = db.config();
    let home = tempfile::tempdir().unwrap();
    let file = home.path().join("services.conf");
    write_service_file(&file, &pg);
    let path = file.display().to_string();

    let by_setting = ConnectConfig::parse_with_env(
        "service=mine",
        env_of(vec![("PGSERVICEFILE", path.clone())]),
    )
    .unwrap();
    assert_eq!(database(&by_setting).await, db.name());

    let by_variable = ConnectConfig::parse_with_env(
        "",
        env_of(vec![
            ("PGSERVICE", "mine".into()),
            ("PGSERVICEFILE", path.clone()),
        ]),
    )
    .unwrap();
    assert_eq!(database(&by_variable).await, db.name());

    // ~/.pg_service.conf when no file is named.
    std::fs::copy(&file, home.path().join(".pg_service.conf")).unwrap();
    let from_home = ConnectConfig::parse_with_env(
        "service=mine",
        env_of(vec![("HOME", home.path().display().to_string())]),
    )
    .unwrap();
    assert_eq!(database(&from_home).await, db.name());

    // The string wins over the service, the service over the variables.
    let config = ConnectConfig::parse_with_env(
        &format!("service=mine servicefile={path} dbname=chosen"),
        env_of(vec![("PGUSER", "from_env".into())]),
    )
    .unwrap();
    assert_eq!(config.pg_config().get_dbname(), Some("chosen"));
    assert_eq!(config.pg_config().get_user(), pg.get_user());

    // An unknown service is refused, naming where its name came from.
    match ConnectConfig::parse_with_env(
        "service=missing",
        env_of(vec![("PGSERVICEFILE", path.clone())]),
    ) {
        Err(Error::Invalid { what, reason }) => {
            assert_eq!(what, "service", "{reason}");
            assert!(reason.contains("\"missing\""), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    match ConnectConfig::parse_with_env(
        "host=h user=u",
        env_of(vec![
            ("PGSERVICE", "missing".into()),
            ("PGSERVICEFILE", path),
        ]),
    ) {
        Err(Error::Invalid { what, .. }) => assert_eq!(what, "PGSERVICE"),
        other => panic!("{other:?}"),
    }
}
