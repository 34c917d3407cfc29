//! `target_session_attrs` and `PGTARGETSESSIONATTRS` choose among the hosts of a list as
//! libpq does: two clusters of the test's own, the first read-only
//! (`default_transaction_read_only`), the second read-write; a host that is not what is
//! asked for is skipped, and when none is, the error names the last host, the phase
//! (checking target_session_attrs) and why.

mod common;

use std::time::Duration;

use pgbus::{ConnectConfig, ConnectPhase, Error};
use pgbus_testkit::embedded::{EmbeddedOptions, EmbeddedPostgres};
use tokio_postgres::config::Host;

const WAIT: Duration = Duration::from_secs(30);

async fn cluster(read_only: bool) -> EmbeddedPostgres {
    let mut options = EmbeddedOptions::default();
    if read_only {
        options = options.setting("default_transaction_read_only", "on");
    }
    EmbeddedPostgres::start(options)
        .await
        .unwrap_or_else(|e| panic!("starting a cluster: {e}"))
}

/// `host=... port=...` for the clusters, in order, and the rest of the first's settings.
fn hosts(clusters: &[&EmbeddedPostgres]) -> String {
    let mut names = Vec::new();
    let mut ports = Vec::new();
    for cluster in clusters {
        let config = cluster.config("postgres");
        names.push(match &config.get_hosts()[0] {
            Host::Tcp(name) => name.clone(),
            Host::Unix(dir) => dir.display().to_string(),
        });
        ports.push(config.get_ports()[0].to_string());
    }
    let config = clusters[0].config("postgres");
    format!(
        "host='{}' port={} user='{}' dbname=postgres sslmode=disable connect_timeout=10",
        names.join(","),
        ports.join(","),
        config.get_user().unwrap()
    )
}

/// Connects; on success, the session's `transaction_read_only`.
async fn read_only(s: &str, env: &[(&str, &str)]) -> Result<bool, Error> {
    let env: Vec<(String, String)> = env
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let config = ConnectConfig::parse_with_env(s, move |name| {
        env.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone())
    })?;
    let client = common::within("connecting", WAIT, config.connect()).await?;
    let row = client
        .query_one("SELECT current_setting('transaction_read_only')", &[])
        .await
        .unwrap();
    Ok(row.get::<_, String>(0) == "on")
}

#[tokio::test]
async fn target_session_attrs_picks_the_host_that_fits() {
    let (ro, rw) = tokio::join!(cluster(true), cluster(false));
    let ro_first = hosts(&[&ro, &rw]);
    let rw_first = hosts(&[&rw, &ro]);

    assert!(read_only(&ro_first, &[]).await.unwrap(), "any: the first");
    assert!(
        !read_only(&format!("{ro_first} target_session_attrs=read-write"), &[])
            .await
            .unwrap()
    );
    assert!(
        !read_only(&ro_first, &[("PGTARGETSESSIONATTRS", "read-write")])
            .await
            .unwrap(),
        "the variable applies when the string says nothing"
    );
    assert!(
        read_only(&format!("{rw_first} target_session_attrs=read-only"), &[])
            .await
            .unwrap()
    );
    // Neither is a standby: prefer-standby takes the first, primary the first too.
    assert!(
        read_only(
            &format!("{ro_first} target_session_attrs=prefer-standby"),
            &[]
        )
        .await
        .unwrap()
    );
    assert!(
        read_only(&format!("{ro_first} target_session_attrs=primary"), &[])
            .await
            .unwrap()
    );

    let e = read_only(&format!("{ro_first} target_session_attrs=standby"), &[])
        .await
        .unwrap_err();
    match &e {
        Error::Connect { phase, earlier, .. } => {
            assert_eq!(*phase, ConnectPhase::CheckingSession, "{e}");
            assert_eq!(earlier.len(), 1, "{e}");
        }
        other => panic!("{other:?}"),
    }
    assert!(e.to_string().contains("not a standby"), "{e}");

    let only_ro = hosts(&[&ro]);
    let e = read_only(&format!("{only_ro} target_session_attrs=read-write"), &[])
        .await
        .unwrap_err();
    assert!(e.to_string().contains("the server is read-only"), "{e}");
    assert!(
        e.to_string().contains("target_session_attrs=read-write"),
        "{e}"
    );
}
