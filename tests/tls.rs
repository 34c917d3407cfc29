//! pgbus over TLS, against the test kit's TLS-only PostgreSQL (`hostssl` only, password
//! login, a certificate for `localhost` signed by the kit's CA): every `sslmode` as libpq
//! means it, a wrong CA and a wrong host name refused with a reason that says so, root
//! certificates from `sslrootcert`, `PGSSLROOTCERT` and `~/.postgresql/root.crt`, and a
//! bus whose pool and LISTEN connection are both encrypted.
//!
//! The certificates libpq accepts are accepted: the self-signed one PostgreSQL's
//! documentation makes (its own root), and one that names the host only in its Common
//! Name; one whose subjectAltName names another host is refused for `verify-full` even
//! when its Common Name matches, as libpq refuses it.
//!
//! Client certificates come from `sslcert`/`sslkey` or, as libpq, from
//! `~/.postgresql/postgresql.crt` and `.key`; a key file others may read is refused.

use std::path::Path;
use std::time::Duration;

use futures::StreamExt;
use pgbus::{Bus, ConnectConfig, Event, SslMode};
use pgbus_testkit::tls::{ServerCertificate, TlsServer};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(20);

/// An environment with only `HOME` (an empty directory unless given), so that neither
/// the machine's `PG*` variables nor its `~/.postgresql` can change the outcome.
fn env_with(home: &Path, vars: &[(&str, String)]) -> impl Fn(&str) -> Option<String> + use<> {
    let mut vars: Vec<(String, String)> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect();
    vars.push(("HOME".into(), home.display().to_string()));
    move |name| vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone())
}

fn empty_home() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

/// Connects with `url` (and `env`); on success, whether the session is encrypted.
async fn encrypted(url: &str, env: impl Fn(&str) -> Option<String>) -> Result<bool, String> {
    let config = ConnectConfig::parse_with_env(url, env).map_err(|e| e.to_string())?;
    let client = config
        .connect()
        .await
        .map_err(|e| pgbus_testkit::error_chain(&e))?;
    let row = client
        .query_one(
            "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
            &[],
        )
        .await
        .unwrap();
    Ok(row.get("ssl"))
}

/// The server's database at `host`, with `sslmode` and `sslrootcert`.
fn at(server: &TlsServer, host: &str, sslmode: &str, root: &str) -> String {
    server.url_to(host, server.database(), sslmode, &[("sslrootcert", root)])
}

/// [`encrypted`] with only `HOME` (`home`) in the environment.
async fn encrypted_at(url: String, home: &Path) -> Result<bool, String> {
    encrypted(&url, env_with(home, &[])).await
}

fn ca(server: &TlsServer) -> String {
    server.ca_pem().display().to_string()
}

fn wrong_ca(server: &TlsServer) -> String {
    server.wrong_ca_pem().display().to_string()
}

#[tokio::test]
async fn modes_that_do_not_check_the_certificate_encrypt_or_are_refused() {
    let server = TlsServer::shared().await;
    let home = empty_home();
    let env = || env_with(home.path(), &[]);
    let refused = encrypted(&server.url("disable", &[]), env())
        .await
        .unwrap_err();
    assert!(refused.contains("no encryption"), "{refused}");
    for mode in ["allow", "prefer", "require"] {
        assert_eq!(
            encrypted(&server.url(mode, &[]), env()).await,
            Ok(true),
            "sslmode={mode}"
        );
    }
    // As libpq: `require` with a root certificate checks the chain like verify-ca.
    let err = encrypted(
        &server.url("require", &[("sslrootcert", &wrong_ca(server))]),
        env(),
    )
    .await
    .unwrap_err();
    assert!(err.contains("UnknownIssuer"), "{err}");
}

#[tokio::test]
async fn verify_ca_checks_the_signer_and_verify_full_also_the_name() {
    let server = TlsServer::shared().await;
    let home = empty_home();
    let (ca, wrong) = (ca(server), wrong_ca(server));
    let connect = |url: String| encrypted_at(url, home.path());
    // The certificate names only `localhost`: by address, only verify-ca accepts it.
    assert_eq!(
        connect(at(server, "localhost", "verify-ca", &ca)).await,
        Ok(true)
    );
    assert_eq!(
        connect(at(server, "127.0.0.1", "verify-ca", &ca)).await,
        Ok(true)
    );
    assert_eq!(
        connect(at(server, "localhost", "verify-full", &ca)).await,
        Ok(true)
    );
    let err = connect(at(server, "127.0.0.1", "verify-full", &ca))
        .await
        .unwrap_err();
    assert!(err.contains("not valid for name"), "{err}");
    for mode in ["verify-ca", "verify-full"] {
        let err = connect(at(server, "localhost", mode, &wrong))
            .await
            .unwrap_err();
        assert!(err.contains("UnknownIssuer"), "{mode}: {err}");
    }
    // No root certificate named and none in ~/.postgresql: the system's store, which
    // does not hold the test's CA.
    let err = connect(server.url("verify-full", &[])).await.unwrap_err();
    assert!(err.contains("UnknownIssuer"), "{err}");
}

#[tokio::test]
async fn root_certificates_come_from_the_environment_and_the_home_directory() {
    let server = TlsServer::shared().await;
    let home = empty_home();
    let from_env = env_with(home.path(), &[("PGSSLROOTCERT", ca(server))]);
    assert_eq!(
        encrypted(&server.url("verify-full", &[]), from_env).await,
        Ok(true)
    );
    std::fs::create_dir(home.path().join(".postgresql")).unwrap();
    std::fs::copy(server.ca_pem(), home.path().join(".postgresql/root.crt")).unwrap();
    assert_eq!(
        encrypted(&server.url("verify-full", &[]), env_with(home.path(), &[])).await,
        Ok(true)
    );
    // PGSSLMODE applies when the string has no sslmode.
    let url = format!(
        "host=localhost port={} user={} password={} dbname={}",
        server.port(),
        server.user(),
        server.password(),
        server.database()
    );
    let env = env_with(home.path(), &[("PGSSLMODE", "verify-full".into())]);
    let config = ConnectConfig::parse_with_env(&url, &env).unwrap();
    assert_eq!(config.ssl_mode(), SslMode::VerifyFull);
    assert_eq!(encrypted(&url, env).await, Ok(true));
}

#[tokio::test]
async fn a_bus_claims_acks_and_listens_over_verified_tls() {
    let server = TlsServer::shared().await;
    let database = server.new_database().await.unwrap();
    let home = empty_home();
    let ca = ca(server);
    let url = server.url_to(
        "localhost",
        &database,
        "verify-full",
        &[("sslrootcert", &ca)],
    );
    let config = ConnectConfig::parse_with_env(&url, env_with(home.path(), &[])).unwrap();
    let mut bus = Bus::builder(config.clone())
        // An hour: only the notification, received over TLS, delivers promptly.
        .poll_interval(Duration::from_secs(3600))
        .build()
        .unwrap();
    let mut sub = bus.subscribe("tls", ["tls.*"]).unwrap();
    let running = bus.start().await.unwrap();
    pgbus_testkit::wait_for("the bus to listen over TLS", WAIT, || async {
        running.is_listening()
    })
    .await;
    let client = config.connect().await.unwrap();
    pgbus::publish(&client, &Event::new("tls.sent", json!({"n": 1})))
        .await
        .unwrap();
    let delivery = pgbus_testkit::within("the event to arrive", WAIT, sub.next())
        .await
        .unwrap();
    assert_eq!(delivery.event().name, "tls.sent");
    delivery.ack().await.unwrap();
    let plain: i64 = client
        .query_one(
            "SELECT count(*) FILTER (WHERE NOT s.ssl) AS plain
             FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid)
             WHERE a.application_name IN ('pgbus worker', 'pgbus listener')",
            &[],
        )
        .await
        .unwrap()
        .get("plain");
    assert_eq!(plain, 0);
    running.shutdown().await.unwrap();
    pgbus_testkit::wait_count(
        &client,
        "the acknowledgement to be written",
        pgbus_testkit::WORK_LEFT,
        0,
    )
    .await;
}

/// Connects to `server` at `host` with `sslmode` and `root`; `Ok(())` or the error.
async fn verdict(server: &TlsServer, host: &str, sslmode: &str, root: &str) -> Result<(), String> {
    let home = empty_home();
    encrypted_at(at(server, host, sslmode, root), home.path())
        .await
        .map(|encrypted| assert!(encrypted))
}

#[tokio::test]
async fn the_documented_self_signed_certificate_is_its_own_root() {
    let server = TlsServer::start_with(ServerCertificate::SelfSigned)
        .await
        .unwrap();
    // sslrootcert is the server's own certificate (`cp server.crt root.crt`).
    let own = ca(&server);
    assert_eq!(
        verdict(&server, "127.0.0.1", "verify-ca", &own).await,
        Ok(())
    );
    assert_eq!(
        verdict(&server, "localhost", "verify-ca", &own).await,
        Ok(())
    );
    // Its only name is its Common Name, which libpq checks when there is no
    // subjectAltName.
    assert_eq!(
        verdict(&server, "localhost", "verify-full", &own).await,
        Ok(())
    );
    let err = verdict(&server, "127.0.0.1", "verify-full", &own)
        .await
        .unwrap_err();
    assert!(err.contains("not valid for name"), "{err}");
    // Another self-signed certificate (the kit's other CA) does not vouch for it.
    for mode in ["verify-ca", "verify-full"] {
        let err = verdict(&server, "localhost", mode, &wrong_ca(&server))
            .await
            .unwrap_err();
        assert!(err.contains("UnknownIssuer"), "{mode}: {err}");
    }
}

#[tokio::test]
async fn a_common_name_names_the_host_only_without_an_alternative_name() {
    let cn_only = TlsServer::start_with(ServerCertificate::CommonNameOnly)
        .await
        .unwrap();
    let ca_pem = ca(&cn_only);
    assert_eq!(
        verdict(&cn_only, "localhost", "verify-full", &ca_pem).await,
        Ok(())
    );
    assert_eq!(
        verdict(&cn_only, "127.0.0.1", "verify-ca", &ca_pem).await,
        Ok(())
    );
    let err = verdict(&cn_only, "127.0.0.1", "verify-full", &ca_pem)
        .await
        .unwrap_err();
    assert!(err.contains("not valid for name"), "{err}");
    let err = verdict(&cn_only, "localhost", "verify-full", &wrong_ca(&cn_only))
        .await
        .unwrap_err();
    assert!(err.contains("UnknownIssuer"), "{err}");

    // A subjectAltName that names another host: the Common Name no longer counts.
    let other = TlsServer::start_with(ServerCertificate::OtherAltName)
        .await
        .unwrap();
    let ca_pem = ca(&other);
    let err = verdict(&other, "localhost", "verify-full", &ca_pem)
        .await
        .unwrap_err();
    assert!(err.contains("not valid for name"), "{err}");
    assert_eq!(
        verdict(&other, "localhost", "verify-ca", &ca_pem).await,
        Ok(())
    );
}

#[tokio::test]
async fn system_roots_insist_on_verify_full() {
    let server = TlsServer::shared().await;
    let home = empty_home();
    for mode in ["require", "verify-ca"] {
        match ConnectConfig::parse_with_env(
            &server.url(mode, &[("sslrootcert", "system")]),
            env_with(home.path(), &[]),
        ) {
            Err(pgbus::Error::Invalid { what, reason }) => {
                assert_eq!(what, "sslmode", "{reason}");
                assert!(reason.contains("verify-full"), "{reason}");
            }
            other => panic!("sslmode={mode}: {other:?}"),
        }
    }
    // Without an sslmode, sslrootcert=system means verify-full (as libpq 16).
    let url = server
        .url("verify-full", &[("sslrootcert", "system")])
        .replace("sslmode=verify-full&", "");
    let config = ConnectConfig::parse_with_env(&url, env_with(home.path(), &[])).unwrap();
    assert_eq!(config.ssl_mode(), SslMode::VerifyFull);
}

/// Writes `text` to `path` with `mode`.
fn write_mode(path: &Path, text: &str, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

#[tokio::test]
async fn client_certificates_come_from_the_home_directory_and_keys_must_be_private() {
    let server = TlsServer::start_requiring_client_certificates()
        .await
        .unwrap();
    let (cert, key) = server.client_certificate();
    // No password: the certificate is the login.
    let url = format!(
        "postgresql://{}@localhost:{}/{}?sslmode=verify-full",
        server.user(),
        server.port(),
        server.database()
    );
    let home = empty_home();
    let dir = home.path().join(".postgresql");
    std::fs::create_dir(&dir).unwrap();
    std::fs::copy(server.ca_pem(), dir.join("root.crt")).unwrap();

    // Without a certificate the server refuses the login.
    let err = encrypted(&url, env_with(home.path(), &[]))
        .await
        .unwrap_err();
    assert!(err.contains("certificate"), "{err}");

    // ~/.postgresql/postgresql.crt and .key are used when they exist.
    write_mode(&dir.join("postgresql.crt"), cert, 0o644);
    write_mode(&dir.join("postgresql.key"), key, 0o600);
    assert_eq!(encrypted(&url, env_with(home.path(), &[])).await, Ok(true));

    // sslcertmode=disable presents none.
    let err = encrypted(
        &format!("{url}&sslcertmode=disable"),
        env_with(home.path(), &[]),
    )
    .await
    .unwrap_err();
    assert!(err.contains("certificate"), "{err}");

    // A key that group or others may read is refused before connecting, as libpq does.
    write_mode(&dir.join("postgresql.key"), key, 0o644);
    match ConnectConfig::parse_with_env(&url, env_with(home.path(), &[])) {
        Err(pgbus::Error::Invalid { what, reason }) => {
            assert_eq!(what, "sslkey", "{reason}");
            assert!(reason.contains("chmod 0600"), "{reason}");
        }
        other => panic!("a readable key was accepted: {other:?}"),
    }

    // sslcert and sslkey name them anywhere; PGSSLCERT and PGSSLKEY too.
    let elsewhere = empty_home();
    let (cert_path, key_path) = (
        elsewhere.path().join("client.crt"),
        elsewhere.path().join("client.key"),
    );
    write_mode(&cert_path, cert, 0o644);
    write_mode(&key_path, key, 0o600);
    let named = format!(
        "{url}&sslrootcert={}&sslcert={}&sslkey={}",
        ca(&server),
        cert_path.display(),
        key_path.display()
    );
    assert_eq!(
        encrypted(&named, env_with(elsewhere.path(), &[])).await,
        Ok(true)
    );
    let from_env = env_with(
        elsewhere.path(),
        &[
            ("PGSSLROOTCERT", ca(&server)),
            ("PGSSLCERT", cert_path.display().to_string()),
            ("PGSSLKEY", key_path.display().to_string()),
        ],
    );
    assert_eq!(encrypted(&url, from_env).await, Ok(true));

    // An encrypted key is refused, naming the setting, rather than failing later.
    let encrypted_key = elsewhere.path().join("encrypted.key");
    write_mode(
        &encrypted_key,
        "-----BEGIN ENCRYPTED PRIVATE KEY-----\nMIIB\n-----END ENCRYPTED PRIVATE KEY-----\n",
        0o600,
    );
    let with_password = format!(
        "{url}&sslcert={}&sslkey={}&sslpassword=secret",
        cert_path.display(),
        encrypted_key.display()
    );
    match ConnectConfig::parse_with_env(&with_password, env_with(elsewhere.path(), &[])) {
        Err(pgbus::Error::Invalid { what, reason }) => {
            assert_eq!(what, "sslkey", "{reason}");
            assert!(reason.contains("sslpassword"), "{reason}");
        }
        other => panic!("an encrypted key was accepted: {other:?}"),
    }
}
